"""Observing what the engine's scheduler decided, injecting faults, and the engine's leak check."""

from __future__ import annotations

from typing import Any

from tests.core.helpers import assert_no_leaks
from tests.hf_reference import hf_greedy
from tokenweir import LLM, SamplingParams
from tokenweir.core.scheduler import SchedulerOutput
from tokenweir.engine.core import EngineCore


def record_schedules(engine: EngineCore) -> list[SchedulerOutput]:
    """Every SchedulerOutput the engine's steps report from now on, in order."""
    outputs: list[SchedulerOutput] = []
    step = engine.step

    def recording_step():
        result = step()
        outputs.append(result.scheduler_output)
        return result

    engine.step = recording_step  # type: ignore[method-assign]
    return outputs


class FailsOnce:
    """Wraps a callable (a model, a sampler) so that its n-th call raises; other attributes
    pass through."""

    def __init__(self, inner: Any, fail_on_call: int, error: Exception) -> None:
        self.inner, self.fail_on_call, self.error, self.calls = inner, fail_on_call, error, 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise self.error
        return self.inner(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def assert_engine_released(engine: EngineCore) -> None:
    """After a test: no request, block or per-request state left in any layer of the engine.

    An idle engine has told its runner of every finished request (no next step would): a finished
    or preempted id lost on the way (a failed step, the last step before going idle) leaves the
    runner's state or a seeded generator behind, and fails here.
    """
    assert_no_leaks(engine.scheduler)
    kv = engine.scheduler.kv_cache_manager
    assert kv.num_cached_blocks == {}, kv.num_cached_blocks
    assert engine.states == {}, list(engine.states)
    assert engine.runner.requests == {}, list(engine.runner.requests)
    assert engine.runner.generators == {}, list(engine.runner.generators)


def assert_async_engine_released(engine: Any) -> None:
    """assert_engine_released for an idle AsyncLLMEngine (its thread waits on its command
    queue, so the test thread may use the core), plus its stream tables."""
    assert engine._side.streams == {} and engine._side.progress == {}, list(engine._side.streams)
    assert engine._active == {}, list(engine._active)
    assert_engine_released(engine.core)


def num_continued_prefill_chunks(outputs: list[SchedulerOutput]) -> int:
    """Steps in which a request already running got more than one token: the second and later
    chunks of a chunked prefill (a decode step gives exactly one)."""
    return sum(1 for out in outputs for rid in out.scheduled_cached_reqs.req_ids
               if out.num_scheduled_tokens.get(rid, 0) > 1)


def greedy_under_scenario(llm: LLM, prompts: list[list[int]], num_new: int, scenario: str) -> list[list[int]]:
    """Greedy outputs of exactly `num_new` tokens, after checking that the scenario the engine
    was configured for happened: prefills split into chunks, preemptions (recompute, swap, auto,
    swap space too small), prefix-cache hits."""
    schedules = record_schedules(llm.engine)
    params = SamplingParams(max_tokens=num_new, min_tokens=num_new, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.get_stats()
    if scenario == "preempted":
        assert stats.num_preemptions > 0
    if scenario == "swapped":  # every preemption a swap, and every swapped request came back
        assert stats.num_preemptions_by_mode["swap"] == stats.num_preemptions > 0
        assert stats.num_blocks_swapped_in > 0
    if scenario == "auto":
        assert stats.num_preemptions > 0
    if scenario == "swap_exhausted":  # a one-block host tier: most victims fall back to recompute
        assert stats.num_preemptions_by_mode["recompute"] > 0
    if scenario == "prefix_hits":
        assert stats.prefix_cache.hits > 0
    if scenario == "chunked":
        assert stats.num_preemptions == 0 and num_continued_prefill_chunks(schedules) > 0
    return [o.outputs[0].token_ids for o in outs]


def greedy_oracle(model_dir: str, prompts: dict[str, list[int]], num_new: int) -> dict[str, list[int]]:
    """transformers' greedy continuation of each named prompt (the correctness oracle)."""
    ids = list(prompts)
    return dict(zip(ids, hf_greedy(model_dir, [prompts[i] for i in ids], num_new, pad_token_id=0)))

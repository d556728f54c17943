"""Observing what the engine's scheduler decided, for tests that must show a scenario happened."""

from __future__ import annotations

from tokenweir import LLM, SamplingParams
from tokenweir.core.scheduler import SchedulerOutput
from tokenweir.engine.core import EngineCore


def record_schedules(engine: EngineCore) -> list[SchedulerOutput]:
    """Every SchedulerOutput the engine's scheduler returns from now on, in order."""
    outputs: list[SchedulerOutput] = []
    engine.on_scheduled = outputs.append
    return outputs


def num_continued_prefill_chunks(outputs: list[SchedulerOutput]) -> int:
    """Steps in which a request already running got more than one token: the second and later
    chunks of a chunked prefill (a decode step gives exactly one)."""
    return sum(1 for out in outputs for cached in out.scheduled_cached_reqs
               if out.num_scheduled_tokens.get(cached.request_id, 0) > 1)


def greedy_under_scenario(llm: LLM, prompts: list[list[int]], num_new: int, scenario: str) -> list[list[int]]:
    """Greedy outputs of exactly `num_new` tokens, after checking that the scenario the engine
    was configured for happened: prefills split into chunks, preemptions, prefix-cache hits."""
    schedules = record_schedules(llm.engine)
    params = SamplingParams(max_tokens=num_new, min_tokens=num_new, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    stats = llm.get_stats()
    if scenario == "preempted":
        assert stats.num_preemptions > 0
    if scenario == "prefix_hits":
        assert stats.prefix_cache.hits > 0
    if scenario == "chunked":
        assert stats.num_preemptions == 0 and num_continued_prefill_chunks(schedules) > 0
    return [o.outputs[0].token_ids for o in outs]

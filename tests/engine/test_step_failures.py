"""A failure inside a step fails exactly the requests that step scheduled: they are aborted
(every block comes back), the runner forgets them and their seeded generators, and every other
request finishes with transformers' greedy output. Faults are injected at each place a step
can break: the forward pass, the sampler, one request's output processing, and between
`schedule()` and `execute()`."""

from __future__ import annotations

from typing import Callable, Optional

import pytest

from tests.engine.helpers import FailsOnce, assert_engine_released, greedy_oracle
from tests.hf_reference import hf_greedy
from tokenweir import SamplingParams
from tokenweir.core.scheduler import SchedulerOutput
from tokenweir.engine.core import EngineCore, StepResult

NUM_NEW = 6
GREEDY = SamplingParams(max_tokens=NUM_NEW, min_tokens=NUM_NEW, temperature=0.0)
PROMPTS = {"a": [5, 6, 7, 8, 9], "b": [10, 11, 12], "c": [13, 14, 15, 16], "d": [17, 18]}
FAIL_AT_STEP = 3  # a and b decode; c and d wait (two sequences at a time)


@pytest.fixture(scope="module")
def oracle(tiny_model_dir) -> dict[str, list[int]]:
    return greedy_oracle(tiny_model_dir("llama"), PROMPTS, NUM_NEW)


@pytest.fixture
def engine(make_llm, tiny_model_dir) -> EngineCore:
    return make_llm(tiny_model_dir("llama"), num_gpu_blocks_override=64, max_num_seqs=2).engine


def run(engine: EngineCore, step_fn: Optional[Callable[[int, SchedulerOutput], StepResult]] = None
        ) -> tuple[dict[str, list[int]], dict[str, BaseException], list[set[str]]]:
    """Add the four requests and step until done: (finished tokens, failures, the ids each
    step that failed something had scheduled)."""
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    finished: dict[str, list[int]] = {}
    failed: dict[str, BaseException] = {}
    failed_steps: list[set[str]] = []
    n = 0
    while engine.has_unfinished_requests():
        n += 1
        scheduled = engine.schedule()
        result = step_fn(n, scheduled) if step_fn else engine.execute(scheduled)
        assert result.scheduler_output is scheduled
        finished.update((o.request_id, o.outputs[0].token_ids) for o in result.outputs if o.finished)
        if result.failed:
            failed.update(result.failed)
            failed_steps.append(set(scheduled.num_scheduled_tokens))
    return finished, failed, failed_steps


def assert_only_the_step_failed(engine, oracle, finished, failed, failed_steps, message):
    assert failed_steps == [{"a", "b"}]
    assert set(failed) == {"a", "b"} and all(message in repr(e) for e in failed.values())
    assert finished == {rid: oracle[rid] for rid in ("c", "d")}
    assert_engine_released(engine)


def test_a_forward_pass_that_raises_fails_only_its_step(engine, oracle):
    engine.runner.model = FailsOnce(engine.runner.model, FAIL_AT_STEP, RuntimeError("device lost"))
    assert_only_the_step_failed(engine, oracle, *run(engine), "device lost")


def test_a_sampler_that_raises_fails_only_its_step(engine, oracle):
    engine.runner.sampler = FailsOnce(engine.runner.sampler, FAIL_AT_STEP, RuntimeError("sampler broke"))
    assert_only_the_step_failed(engine, oracle, *run(engine), "sampler broke")


def test_an_exception_between_schedule_and_execute_fails_only_that_step(engine, oracle):
    def step(n, scheduled):
        if n == FAIL_AT_STEP:
            return engine.fail_step(scheduled, RuntimeError("caller failed"))
        return engine.execute(scheduled)

    assert_only_the_step_failed(engine, oracle, *run(engine, step), "caller failed")


def test_output_processing_that_raises_fails_only_that_request(engine, oracle, monkeypatch):
    process_tokens = engine.output_processor.process_tokens

    def failing(state, *args, **kwargs):
        if state.request.request_id == "a" and state.request.num_output_tokens == 2:
            raise RuntimeError("detokenizer exploded")
        return process_tokens(state, *args, **kwargs)

    monkeypatch.setattr(engine.output_processor, "process_tokens", failing)
    finished, failed, _ = run(engine)
    assert list(failed) == ["a"] and "detokenizer exploded" in repr(failed["a"])
    assert finished == {rid: oracle[rid] for rid in ("b", "c", "d")}
    assert_engine_released(engine)


def test_a_failed_forward_can_be_run_again(engine, oracle):
    """The runner commits a step only once it succeeded: the same SchedulerOutput run again
    after a failed forward gives the right tokens (before, the runner had already advanced its
    own computed-token count and extended its block tables)."""
    for rid in ("a", "b"):
        engine.add_request(rid, PROMPTS[rid], GREEDY)
    model = engine.runner.model
    finished = {}
    while engine.has_unfinished_requests():
        scheduled = engine.schedule()
        engine.runner.model = FailsOnce(model, 1, RuntimeError("transient"))
        with pytest.raises(RuntimeError, match="transient"):
            engine.runner.execute_model(scheduled)
        engine.runner.model = model
        result = engine.execute(scheduled)
        assert not result.failed
        finished.update((o.request_id, o.outputs[0].token_ids) for o in result.outputs if o.finished)
    assert finished == {rid: oracle[rid] for rid in ("a", "b")}


def test_a_failed_step_does_not_leave_a_stale_generator_for_a_reused_id(engine):
    """A seeded request finishes while another still runs; the next step, which would tell the
    runner so, fails before the runner runs. The id comes back with the same seed: it must draw
    the same stream again, not continue the old request's generator."""
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)

    def run_alone() -> list[int]:
        engine.add_request("s", [5, 6, 7], seeded)
        tokens = None
        while engine.has_unfinished_requests():
            for out in engine.step().outputs:
                tokens = out.outputs[0].token_ids
        return tokens

    first = run_alone()
    assert "s" not in engine.runner.generators  # idle: the runner was told at once
    engine.add_request("bg", [9, 9], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    engine.add_request("s", [5, 6, 7], seeded)
    while "s" in engine.states:
        engine.step()
    assert "s" in engine.runner.generators  # "bg" runs on: the next step would tell the runner
    scheduled = engine.schedule()
    assert "s" in scheduled.finished_req_ids
    engine.fail_step(scheduled, RuntimeError("caller failed"))
    assert "s" not in engine.runner.generators
    assert run_alone() == first


def test_an_engine_that_goes_idle_keeps_no_finished_request_state(engine):
    engine.add_request("seeded", [5, 6, 7], SamplingParams(max_tokens=3, temperature=1.0, seed=3))
    engine.add_request("aborted", [8, 9], SamplingParams(max_tokens=30, temperature=1.0, seed=4))
    engine.step()
    engine.step()
    engine.abort_requests(["aborted"])
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.runner.requests == {} and engine.runner.generators == {}


@pytest.mark.parametrize("fault", ["forward", "between_schedule_and_execute"])
def test_a_failed_step_that_preempted_leaves_nothing_behind(make_llm, tiny_model_dir, fault):
    """The first step that preempts fails: its requests fail, the victims it preempted (their
    runner state dropped, told while the step fails) and everyone else finish with the oracle."""
    from tests.engine.test_equivalence import NUM_NEW as N, SCENARIOS, make_prompts
    from tests.model.tiny_models import VOCAB_SIZE

    folder = tiny_model_dir("llama")
    engine = make_llm(folder, **SCENARIOS["preempted"]).engine
    prompts = make_prompts(VOCAB_SIZE)
    expected = dict(enumerate(hf_greedy(folder, prompts, N, pad_token_id=0)))
    params = SamplingParams(max_tokens=N, min_tokens=N, temperature=0.0)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    finished, failed, failed_step = {}, {}, None
    while engine.has_unfinished_requests():
        scheduled = engine.schedule()
        if failed_step is None and scheduled.preempted_req_ids:
            failed_step = set(scheduled.num_scheduled_tokens)
            victims = scheduled.preempted_req_ids - failed_step
            assert victims  # the test needs a victim that is not re-admitted in the same step
            if fault == "forward":
                engine.runner.model = FailsOnce(engine.runner.model, 1, RuntimeError("device lost"))
                result = engine.execute(scheduled)
                engine.runner.model = engine.runner.model.inner
            else:
                result = engine.fail_step(scheduled, RuntimeError("caller failed"))
            assert not victims & engine.runner.requests.keys()
        else:
            result = engine.execute(scheduled)
        finished.update((o.request_id, o.outputs[0].token_ids) for o in result.outputs if o.finished)
        failed.update(result.failed)
    assert failed_step and set(failed) == failed_step
    assert finished == {str(i): e for i, e in expected.items() if str(i) not in failed_step}
    assert_engine_released(engine)


def test_an_exception_while_the_scheduler_applies_the_step_fails_only_its_step(engine, oracle):
    # Two blocks publications per step (a, then b): call 2 * FAIL_AT_STEP is b's in that step,
    # after a's token was applied. The step is half applied when it raises; fail_step settles it.
    kv = engine.scheduler.kv_cache_manager
    kv.cache_blocks = FailsOnce(kv.cache_blocks, 2 * FAIL_AT_STEP, RuntimeError("publishing broke"))
    assert_only_the_step_failed(engine, oracle, *run(engine), "publishing broke")
    assert engine.scheduler.step_in_flight is None and engine.scheduler.running == []

"""AsyncLLMEngine without HTTP: streaming, abort, and failures that stay contained."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from prometheus_client import CollectorRegistry

from tests.engine.helpers import FailsOnce
from tests.hf_reference import hf_greedy
from tests.server.conftest import MAX_MODEL_LEN, assert_engine_clean, hold_calls, make_engine, wait_until
from tests.server.helpers import MODEL, cancel_adds_before_their_acks, slow_down_steps
from tokenweir.core.scheduler import SchedulerStats
from tokenweir.engine.client import EngineDeadError, RequestFailedError
from tokenweir.engine.client import EngineClient, ModelInfo
from tokenweir.request import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture
def clean(engine):
    yield engine
    assert_engine_clean(engine)


async def collect(engine, request_id, prompt, params=GREEDY, **kwargs):
    return [out async for out in engine.generate(request_id, prompt, params, **kwargs)]


def test_generate_streams_cumulative_outputs(clean, monkeypatch):
    # Steps of >= 20 ms give the consumer time to read each output before the next: a stream
    # hands over only its newest output, so a consumer slower than the engine reads merged ones.
    slow_down_steps(clean.core, monkeypatch, 0.02)
    outputs = asyncio.run(collect(clean, "stream", [5, 6, 7]))
    token_counts = [len(o.outputs[0].token_ids) for o in outputs]
    # Outputs arrive one step at a time, each with more tokens than the one before.
    assert len(outputs) > 1
    assert all(a < b for a, b in zip(token_counts, token_counts[1:])) and token_counts[-1] == 6
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert outputs[-1].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("prompt,match", [([], "empty"), (list(range(1, 10)) * 40, "max_model_len"),
                                          ([1, 100000], "token ids")])
def test_bad_prompt_raises_value_error_and_the_engine_goes_on(clean, prompt, match):
    async def run():
        with pytest.raises(ValueError, match=match):
            await collect(clean, "bad", prompt)
        return await collect(clean, "good", [5, 6, 7])

    assert asyncio.run(run())[-1].finished


def test_duplicate_request_id_is_rejected(clean):
    async def run():
        first = await clean.add_request("dup", [5, 6], GREEDY)
        with pytest.raises(ValueError, match="already in use"):
            await clean.add_request("dup", [5, 6], GREEDY)
        return [out async for out in first]

    assert asyncio.run(run())[-1].outputs[0].finish_reason == "length"


def test_an_id_reused_after_its_stream_was_closed_early_names_the_new_request(clean):
    # Closing a stream early frees its id at once; the old request's final (aborted) output
    # comes later and must not take the new request's registration with it, or aborting the
    # new one would do nothing and it would run to max_tokens.
    async def run():
        params = SamplingParams(max_tokens=MAX_MODEL_LEN - 10, ignore_eos=True)
        first = await clean.add_request("reused", [5, 6, 7], params)
        await first.__anext__()
        await first.aclose()
        second = await clean.add_request("reused", [5, 6, 7], params)
        await second.__anext__()
        wait_until(lambda: clean.num_unfinished_requests() == 1, "the first request's abort")
        await asyncio.sleep(0.05)  # its final output reaches the loop
        clean.abort("reused")
        return [out async for out in second]

    rest = asyncio.run(run())
    assert rest[-1].outputs[0].finish_reason == "abort"
    assert len(rest[-1].outputs[0].token_ids) < MAX_MODEL_LEN - 10


def test_abort_ends_the_stream(clean):
    async def run():
        params = SamplingParams(max_tokens=MAX_MODEL_LEN - 10, ignore_eos=True)
        outputs = await clean.add_request("to-abort", [5, 6, 7], params)
        first = await outputs.__anext__()
        clean.abort("to-abort")
        rest = [out async for out in outputs]
        return first, rest

    first, rest = asyncio.run(run())
    assert not first.finished
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"


def num_aborted(engine) -> float:
    return engine.metrics_registry.get_sample_value(
        "tokenweir:request_success_total", {"model_name": MODEL, "finished_reason": "abort"}) or 0.0


def test_leaving_the_stream_early_aborts(clean):
    async def run():
        params = SamplingParams(max_tokens=MAX_MODEL_LEN - 10, ignore_eos=True)
        async for out in clean.generate("left", [5, 6, 7], params):
            assert not out.finished
            break

    before = num_aborted(clean)
    asyncio.run(run())
    # The request ended by the abort, not by running to max_tokens in the background.
    wait_until(lambda: clean.num_unfinished_requests() == 0, "the engine to go idle")
    assert num_aborted(clean) == before + 1


@pytest.mark.parametrize("how", ["aclose", "drop"])
def test_outputs_closed_or_dropped_before_reading_abort(clean, how):
    # An async generator's aclose() does nothing before its first iteration: the outputs of
    # add_request must abort their request even when nobody ever read from them.
    async def run():
        params = SamplingParams(max_tokens=MAX_MODEL_LEN - 10, ignore_eos=True)
        outputs = await clean.add_request(f"unread-{how}", [5, 6, 7], params)
        if how == "aclose":
            await outputs.aclose()
        else:
            del outputs
            await asyncio.sleep(0.05)  # the abort is posted to this loop

    before = num_aborted(clean)
    asyncio.run(run())
    wait_until(lambda: clean.num_unfinished_requests() == 0, "the engine to go idle")
    assert num_aborted(clean) == before + 1


def test_output_processing_error_fails_only_that_request(clean, monkeypatch):
    processor = clean.core.output_processor
    process_tokens = processor.process_tokens

    def failing(state, *args, **kwargs):
        if state.request.request_id == "bad" and state.request.num_output_tokens >= 2:
            raise RuntimeError("detokenizer exploded")
        return process_tokens(state, *args, **kwargs)

    monkeypatch.setattr(processor, "process_tokens", failing)

    async def run():
        return await asyncio.gather(collect(clean, "bad", [5, 6, 7]), collect(clean, "good", [8, 9]),
                                    return_exceptions=True)

    bad, good = asyncio.run(run())
    assert isinstance(bad, RequestFailedError) and "detokenizer exploded" in str(bad)
    assert good[-1].outputs[0].finish_reason == "length" and len(good[-1].outputs[0].token_ids) == 6


ORACLE_PARAMS = SamplingParams(max_tokens=6, min_tokens=6, temperature=0.0)


@pytest.fixture
def one_at_a_time(tiny_model_dir):
    """An engine that runs one request per step: "a" (added first) runs alone while "b" waits."""
    engine = make_engine(tiny_model_dir("llama"), max_num_seqs=1)
    yield engine
    assert_engine_clean(engine)
    engine.shutdown()


def run_a_and_b(engine):
    async def run():
        return await asyncio.gather(collect(engine, "a", [5, 6, 7], ORACLE_PARAMS),
                                    collect(engine, "b", [8, 9], ORACLE_PARAMS), return_exceptions=True)

    return asyncio.run(run())


@pytest.mark.parametrize("fault", ["forward", "between_schedule_and_execute"])
def test_a_failed_step_fails_only_its_requests(one_at_a_time, tiny_model_dir, monkeypatch, fault):
    engine = one_at_a_time
    if fault == "forward":
        engine.core.runner.model = FailsOnce(engine.core.runner.model, 3, RuntimeError("device lost"))
    else:
        monkeypatch.setattr(engine, "on_waiting", FailsOnce(engine.on_waiting, 3, RuntimeError("device lost")))
    a, b = run_a_and_b(engine)
    assert isinstance(a, RequestFailedError) and "device lost" in str(a)
    # "b" was in flight (waiting) but not in the failed step: it runs on, to the oracle's tokens.
    assert b[-1].outputs[0].token_ids == hf_greedy(tiny_model_dir("llama"), [[8, 9]], 6, pad_token_id=0)[0]
    assert engine.is_running


def test_the_engine_client_interface(clean, monkeypatch):
    assert isinstance(clean, EngineClient)
    assert clean.model_info == ModelInfo(MODEL, MAX_MODEL_LEN, 256)
    assert clean.tokenizer.decode(clean.tokenizer.encode("hello world", add_special_tokens=False)) == "hello world"
    assert clean.is_running and clean.dead_error is None
    assert isinstance(clean.metrics_registry, CollectorRegistry)
    assert clean.metrics_registry.get_sample_value("tokenweir:num_requests_running", {"model_name": MODEL}) == 0
    entered, release = hold_calls(clean.core, "schedule", monkeypatch)

    async def run():
        outputs = await clean.add_request("held", [5, 6, 7], GREEDY)
        await asyncio.to_thread(entered.wait)
        waiting = clean.num_waiting_requests()
        clean.abort("held")
        clean.abort("unknown")  # ignored
        release.set()
        return waiting, [out async for out in outputs]

    waiting, outputs = asyncio.run(run())
    assert waiting == 1
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    stats = clean.get_stats()
    assert isinstance(stats, SchedulerStats) and stats.num_running == 0 and stats.num_waiting == 0


def test_shutdown_fails_streams_and_later_calls(tiny_model_dir, make_server):
    engine = make_engine(tiny_model_dir("llama"))
    url = make_server(engine)

    async def run():
        params = SamplingParams(max_tokens=MAX_MODEL_LEN - 10, ignore_eos=True)
        outputs = await engine.add_request("long", [5, 6, 7], params)
        await outputs.__anext__()
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in outputs:
                pass
        with pytest.raises(EngineDeadError):
            await collect(engine, "late", [5, 6])

    asyncio.run(run())
    assert not engine.is_running
    assert_engine_clean(engine)
    assert httpx.get(f"{url}/health").status_code == 503
    response = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"})
    assert response.status_code == 503 and "Retry-After" in response.headers
    assert response.json()["error"]["code"] == "engine_dead"


def test_an_add_cancelled_before_its_ack_leaves_nothing(clean, monkeypatch):
    """The add and its abort in one command batch: the request is accepted before the abort's
    final output, which ends its stream (before the fix its stream and id stayed taken)."""
    slow_down_steps(clean.core, monkeypatch, 0.05)  # the adds and aborts queue up during a step
    asyncio.run(cancel_adds_before_their_acks(clean))

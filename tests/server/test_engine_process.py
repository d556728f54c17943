"""MPAsyncLLMEngine: the engine loop in a process of its own, behind the same front.

One engine process serves the module (starting one loads torch and the model: seconds). Each
test leaves it idle with nothing running, waiting or holding a KV block, as the engine process
reports it; the kill test starts its own.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Callable, Iterator

import openai
import pytest

from tests.hf_reference import hf_greedy
from tests.server.conftest import BLOCK_SIZE, MAX_MODEL_LEN, NUM_BLOCKS, ServerThread, wait_until
from tests.server.helpers import MODEL, cancel_adds_before_their_acks
from tokenweir.config import EngineArgs
from tokenweir.engine.client import EngineClient, EngineDeadError, ModelInfo
from tokenweir.engine.core_process import MPAsyncLLMEngine
from tokenweir.request import ParameterError, SamplingParams
from tokenweir.server.app import build_app

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def make_mp_engine(model_dir: str, **overrides) -> MPAsyncLLMEngine:
    args = dict(model=model_dir, dtype="float32", device="cpu", num_gpu_blocks_override=NUM_BLOCKS,
                block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, served_model_name=MODEL,
                disable_log_stats=True)
    return MPAsyncLLMEngine(EngineArgs(**{**args, **overrides}), startup_timeout_s=300)


def assert_idle_and_released(engine: MPAsyncLLMEngine) -> None:
    wait_until(lambda: engine.num_unfinished_requests() == 0, "the engine to go idle")
    stats = engine.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.num_swapped) == (0, 0, 0), stats
    assert stats.kv_cache_usage == 0.0, stats
    assert engine._side.streams == {} and engine._side.progress == {} and engine._pending == {}
    assert engine._active == {}


@pytest.fixture(scope="module")
def mp_engine(tiny_model_dir: Callable[[str], str]) -> Iterator[MPAsyncLLMEngine]:
    engine = make_mp_engine(tiny_model_dir("llama"))
    yield engine
    engine.shutdown()
    assert engine.process.exitcode == 0
    assert not engine.is_running and "shut down" in str(engine.dead_error)


@pytest.fixture
def clean(mp_engine: MPAsyncLLMEngine) -> Iterator[MPAsyncLLMEngine]:
    yield mp_engine
    assert_idle_and_released(mp_engine)


async def collect(engine, request_id, prompt, params=GREEDY):
    return [out async for out in engine.generate(request_id, prompt, params)]


def test_the_engine_process_freezes_its_startup_heap(clean):
    # Its model, tokenizer and imported libraries live until it exits: out of every later full
    # collection's walk (gc_heap.py). Torch and transformers alone are far more than this.
    assert clean.gc_frozen_objects > 50_000


def test_streams_match_transformers_greedy_under_concurrency(clean, tiny_model_dir):
    assert isinstance(clean, EngineClient)
    assert clean.model_info == ModelInfo(MODEL, MAX_MODEL_LEN, 256)
    assert clean.process.pid != os.getpid() and clean.process.is_alive()
    prompts = {f"r{i}": [5 + i, 6, 7 + 2 * i, 9][: 2 + i % 3] for i in range(6)}
    tokens_before = clean.metrics.generation_tokens._value.get()

    async def run():
        return await asyncio.gather(*(collect(clean, rid, p) for rid, p in prompts.items()))

    results = dict(zip(prompts, asyncio.run(run())))
    want = hf_greedy(tiny_model_dir("llama"), list(prompts.values()), 6, pad_token_id=0)
    for (rid, outs), expected in zip(results.items(), want):
        assert outs[-1].finished and outs[-1].outputs[0].token_ids == expected, rid
    # The front counted every token the engine process produced.
    assert clean.metrics.generation_tokens._value.get() - tokens_before == 6 * 6


def test_bad_input_is_a_value_error_from_the_engine_process_and_others_go_on(clean):
    async def run():
        with pytest.raises(ValueError, match="token ids must be integers"):
            await collect(clean, "bad-prompt", [1, 100000])
        with pytest.raises(ValueError, match="stop_token_ids"):
            await collect(clean, "bad-stop", [5, 6], SamplingParams(max_tokens=2, stop_token_ids=[999]))
        return await collect(clean, "good", [5, 6, 7])

    assert asyncio.run(run())[-1].finished


def test_a_parameter_error_keeps_its_param_across_the_pipe():
    import pickle
    error = pickle.loads(pickle.dumps(ParameterError("top_p", "top_p must be in (0, 1]")))
    assert type(error) is ParameterError and error.param == "top_p" and str(error) == "top_p must be in (0, 1]"


def test_leaving_a_stream_early_aborts_it_in_the_engine_process(clean):
    aborted_before = clean.metrics.request_success["abort"]._value.get()

    async def run():
        outputs = await clean.add_request("left", [5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True))
        first = await outputs.__anext__()
        await outputs.aclose()
        return first

    first = asyncio.run(run())
    assert not first.finished
    assert_idle_and_released(clean)
    # It ended as aborted, not by running on to its 200 tokens.
    assert clean.metrics.request_success["abort"]._value.get() - aborted_before == 1


def test_the_openai_client_streams_through_the_server(clean):
    server = ServerThread(build_app(clean))
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        stream = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=5, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        chunks = list(stream)
        full = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=5, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
        assert full.usage.completion_tokens == 5
        with pytest.raises(openai.BadRequestError, match="token ids"):
            client.completions.create(model=MODEL, prompt=[1, 100000], max_tokens=2)
    finally:
        server.stop()


def test_a_killed_engine_process_fails_every_stream_and_every_later_call(tiny_model_dir):
    engine = make_mp_engine(tiny_model_dir("llama"))
    try:
        async def run():
            outputs = await engine.add_request("doomed", [5, 6, 7], SamplingParams(max_tokens=10_000,
                                                                                   ignore_eos=True))
            await outputs.__anext__()  # it is running in the engine process
            os.kill(engine.process.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="exited with code -9"):
                async for _ in outputs:
                    pass
            with pytest.raises(EngineDeadError):
                await engine.add_request("late", [5, 6], GREEDY)

        asyncio.run(run())
        engine._thread.join(10)  # the reader has failed everything and ended
        assert not engine.is_running and not engine._thread.is_alive()
        assert engine._side.streams == {} and engine._pending == {}
    finally:
        engine.shutdown()


def test_a_sigterm_to_the_engine_process_lets_its_streams_finish(clean):
    # What a supervisor's SIGTERM to the whole process group delivers to the engine process:
    # the server drains its streams and then closes the pipe; the engine must serve them.
    async def run():
        outputs = await clean.add_request("drained", [5, 6, 7], SamplingParams(max_tokens=40, ignore_eos=True))
        await outputs.__anext__()
        os.kill(clean.process.pid, signal.SIGTERM)
        return [out async for out in outputs]

    outputs = asyncio.run(run())
    assert outputs[-1].outputs[0].finish_reason == "length" and len(outputs[-1].outputs[0].token_ids) == 40
    assert clean.is_running and clean.process.is_alive()


def test_shutdown_kills_an_engine_process_that_does_not_answer(tiny_model_dir):
    import threading

    engine = make_mp_engine(tiny_model_dir("llama"))
    engine.shutdown_timeout_s = 1.0
    os.kill(engine.process.pid, signal.SIGSTOP)  # a process hung in a step, as far as the server sees
    stopper = threading.Thread(target=engine.shutdown)
    stopper.start()
    stopper.join(60)
    assert not stopper.is_alive(), "shutdown waited for a process that does not answer"
    assert not engine.process.is_alive() and not engine.is_running


def test_health_answers_503_while_a_stopped_engine_process_holds_a_request(clean):
    """SIGSTOP: the engine process makes no progress, as a hung one would. A request sent to it
    stays on its way in; once that lasts past --engine-hang-timeout /health answers 503, and
    after SIGCONT the request is served and /health answers 200."""
    import httpx

    server = ServerThread(build_app(clean, engine_hang_timeout=0.5))
    pid = clean.process.pid
    try:
        assert httpx.get(f"{server.url}/health").status_code == 200

        async def run():
            os.kill(pid, signal.SIGSTOP)
            try:
                adding = asyncio.create_task(collect(clean, "held", [5, 6, 7]))
                deadline = time.monotonic() + 60
                while (clean.stalled_seconds() or 0) <= 0.6:
                    assert time.monotonic() < deadline, "no stall seen while the engine process is stopped"
                    await asyncio.sleep(0.05)
                answer = await asyncio.to_thread(httpx.get, f"{server.url}/health")
                assert answer.status_code == 503 and answer.json()["error"]["code"] == "engine_stalled"
                assert not adding.done()
            finally:
                os.kill(pid, signal.SIGCONT)
            return await adding

        outputs = asyncio.run(run())
        assert len(outputs[-1].outputs[0].token_ids) == GREEDY.max_tokens
        wait_until(lambda: clean.stalled_seconds() is None, "the engine idle again")
        assert httpx.get(f"{server.url}/health").status_code == 200
    finally:
        server.stop()


def test_a_bad_model_path_raises_in_the_servers_process(tmp_path):
    with pytest.raises(Exception, match=str(tmp_path / "missing")) as info:
        MPAsyncLLMEngine(EngineArgs(model=str(tmp_path / "missing"), device="cpu"), startup_timeout_s=300)
    assert not isinstance(info.value, RuntimeError) or "did not start" not in str(info.value)


def test_outputs_equal_the_in_process_engines_with_logprobs_seeds_and_stop_strings(clean, engine):
    """Every output of a stream, as the in-process engine (the session's `engine`) gives them:
    the deltas rebuild tokens, text (cut back by a stop string), logprobs and finish reasons."""
    cases = {
        "seeded": ([5, 6, 7], SamplingParams(max_tokens=12, temperature=0.8, seed=3, logprobs=2, ignore_eos=True)),
        "greedy": ([8, 9], SamplingParams(max_tokens=10, temperature=0.0, logprobs=1, ignore_eos=True)),
    }

    async def run(eng):
        return await asyncio.gather(*(collect(eng, rid, p, params) for rid, (p, params) in cases.items()))

    in_process = asyncio.run(run(engine))
    finals = [outs[-1] for outs in in_process]
    # A stop string from inside the greedy text: the text is held back, then cut there.
    text = finals[1].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    if stop:
        cases["stopped"] = ([8, 9], SamplingParams(max_tokens=10, temperature=0.0, stop=[stop], ignore_eos=True))
        in_process = asyncio.run(run(engine))
    in_engine_process = asyncio.run(run(clean))

    def comparable(o):
        c = o.outputs[0]
        return (o.request_id, o.prompt_token_ids, o.finished, c.text, c.token_ids, c.finish_reason,
                c.stop_reason, [list(d) for d in c.logprobs or ()])

    def logprob_values(o):
        c = o.outputs[0]
        return [v for d in c.logprobs or () for v in d.values()] + [c.cumulative_logprob or 0.0]

    assert [comparable(outs[-1]) for outs in in_engine_process] == [comparable(outs[-1]) for outs in in_process]
    # The two engines may batch the requests differently (when each arrives is timing), and a
    # different batch shape changes the last bits of fp32 logits: values equal to rounding.
    for a, b in zip(in_engine_process, in_process):
        assert logprob_values(a[-1]) == pytest.approx(logprob_values(b[-1]), rel=1e-4, abs=1e-5)
    for outs in in_engine_process:  # cumulative: each output extends the one before
        for before, after in zip(outs, outs[1:]):
            assert after.outputs[0].token_ids[:len(before.outputs[0].token_ids)] == before.outputs[0].token_ids


def test_an_add_cancelled_before_its_ack_leaves_nothing(clean):
    asyncio.run(cancel_adds_before_their_acks(clean))


def test_the_event_loop_never_waits_for_a_busy_engine_to_read_its_commands(clean):
    """The engine reads commands between steps: while it is busy (stopped here), commands larger
    than the pipe's buffer must not block the event loop. The loop itself resumes the engine
    once its adds are submitted; had it blocked writing them, only the watchdog would."""
    import threading

    pid = clean.process.pid
    watchdog_fired = threading.Event()

    def watchdog() -> None:
        if not resumed.wait(30):
            watchdog_fired.set()
            os.kill(pid, signal.SIGCONT)

    resumed = threading.Event()
    big_text = "x" * 200_000  # carried with the command: several of them overflow a pipe buffer

    async def run():
        os.kill(pid, signal.SIGSTOP)
        threading.Thread(target=watchdog, daemon=True).start()
        tasks = [asyncio.ensure_future(collect_with_text(clean, f"big{i}", big_text)) for i in range(4)]
        for _ in range(10):
            await asyncio.sleep(0)
        os.kill(pid, signal.SIGCONT)
        resumed.set()
        return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    assert not watchdog_fired.is_set(), "the event loop blocked while the engine was busy"
    assert all(outs[-1].finished for outs in results)


async def collect_with_text(engine, request_id, prompt_text):
    outputs = await engine.add_request(request_id, [5, 6, 7], GREEDY, prompt_text=prompt_text)
    return [out async for out in outputs]


def test_the_engine_process_honours_the_logging_level_variable(tiny_model_dir, monkeypatch, capfd):
    """It is spawned with the server's environment and calls configure_logging, which reads
    TOKENWEIR_LOGGING_LEVEL: the sla policy's score parts reach the shared stderr."""
    monkeypatch.setenv("TOKENWEIR_LOGGING_LEVEL", "DEBUG")
    engine = make_mp_engine(tiny_model_dir("llama"), scheduling_policy="sla")
    try:
        assert asyncio.run(collect(engine, "explained", [5, 6, 7]))[-1].finished
    finally:
        engine.shutdown()
    err = capfd.readouterr().err
    assert re.search(r"^DEBUG .* tokenweir\.sla: sla t=\S+ load=\S+ next explained: \{'base': ", err, re.MULTILINE), err

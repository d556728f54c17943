"""Many streams at once (also while a prompt is tokenized), overload (429), and clients that go
away mid-request."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server.conftest import assert_engine_clean, wait_until
from tests.server.helpers import MODEL, async_client, post, scrape, slow_down_steps, value

WORDS = "the a of to in is it you that he was for on are with as his they be at one have this".split()


def test_32_concurrent_streams_complete(server):
    lengths = [4 + i % 13 for i in range(32)]

    def request(i, n):
        # Seeded sampling: reproducible like greedy, and it spells text, which the tiny random
        # model's greedy picks often do not.
        prompt = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(3 + i % 7))
        return dict(model=MODEL, prompt=prompt, max_tokens=n, temperature=0.8, seed=i,
                    extra_body={"ignore_eos": True})

    async def streamed(ac, i, n):
        stream = await ac.completions.create(**request(i, n), stream=True, stream_options={"include_usage": True})
        choices, usage = [], None
        async for chunk in stream:
            choices += chunk.choices
            usage = chunk.usage or usage
        return choices, usage

    async def not_streamed(ac, i, n):
        return await ac.completions.create(**request(i, n))

    async def run(one):
        ac = async_client(server)
        results = await asyncio.gather(*(one(ac, i, n) for i, n in enumerate(lengths)))
        await ac.close()
        return results

    streams = asyncio.run(run(streamed))
    fulls = asyncio.run(run(not_streamed))
    for (choices, usage), full, n in zip(streams, fulls, lengths):
        assert usage.completion_tokens == full.usage.completion_tokens == n
        assert [c.finish_reason for c in choices] == [None] * (len(choices) - 1) + ["length"]
        assert "".join(c.text for c in choices) == full.choices[0].text
        # A chunk goes out only with new text, except the last one (it carries finish_reason),
        # and each one brings at least one new token.
        assert all(c.text for c in choices[:-1])
        assert len(choices) <= n
    assert sum(bool(full.choices[0].text) for full in fulls) > 16  # not a comparison of empty strings


def test_429_past_the_waiting_limit(make_server, engine, gate):
    url = make_server(max_waiting_requests=2)
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": 3, "ignore_eos": True}
    with ThreadPoolExecutor(2) as pool:
        held = [pool.submit(post, url, "/v1/completions", body) for _ in range(2)]
        # The engine is held before its first step: both requests wait.
        wait_until(lambda: engine.num_waiting_requests() == 2, "two waiting requests")
        rejected = post(url, "/v1/completions", body)
        assert rejected.status_code == 429
        assert int(rejected.headers["Retry-After"]) >= 1
        assert rejected.json()["error"]["code"] == "rate_limit_exceeded"
        gate.set()
        assert [f.result().status_code for f in held] == [200, 200]
    assert post(url, "/v1/completions", body).status_code == 200


def test_health_answers_503_while_the_engine_makes_no_progress_with_requests(make_server, engine, gate):
    """Held before its step (the gate), the engine makes no progress, as a hung one would: once
    that lasts past --engine-hang-timeout with a request to serve, /health says so; it answers
    200 again as soon as the engine steps, and the request is served."""
    url = make_server(engine_hang_timeout=0.3)
    assert httpx.get(f"{url}/health").status_code == 200 and engine.stalled_seconds() is None  # idle
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": 3, "ignore_eos": True}
    with ThreadPoolExecutor(2) as pool:
        held = pool.submit(post, url, "/v1/completions", body)
        wait_until(lambda: (engine.stalled_seconds() or 0) > 0.4, "the engine held past the timeout")
        answer = httpx.get(f"{url}/health")
        assert answer.status_code == 503 and "Retry-After" in answer.headers
        assert answer.json()["error"]["code"] == "engine_stalled"
        assert "--engine-hang-timeout 0.3 s" in answer.json()["error"]["message"]
        # Another request to the held engine does not start the count again: it still has none
        # of its work done.
        held_too = pool.submit(post, url, "/v1/completions", body)
        wait_until(lambda: engine.num_waiting_requests() == 2, "two requests waiting")
        assert engine.stalled_seconds() > 0.4
        # A longer timeout (or 0: off) is not reached.
        assert httpx.get(f"{make_server(engine_hang_timeout=60)}/health").status_code == 200
        assert httpx.get(f"{make_server(engine_hang_timeout=0)}/health").status_code == 200
        gate.set()
        assert held.result().status_code == 200 and held_too.result().status_code == 200
    wait_until(lambda: engine.stalled_seconds() is None, "the engine idle again")
    assert httpx.get(f"{url}/health").status_code == 200


def test_health_answers_200_while_the_engine_steps_past_the_timeout(make_server, engine, monkeypatch):
    """Each step reports: a request served over many times the timeout, in steps shorter than
    it, keeps /health at 200 throughout."""
    slow_down_steps(engine.core, monkeypatch, 0.05)
    url = make_server(engine_hang_timeout=0.3)
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": 30, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        served = pool.submit(post, url, "/v1/completions", body)
        answers = []
        while not served.done():
            answers.append(httpx.get(f"{url}/health").status_code)
            time.sleep(0.05)
        assert served.result().status_code == 200
    assert len(answers) > 10 and set(answers) == {200}


def test_a_burst_gets_exactly_the_waiting_limit_and_429s_for_the_rest(make_server, engine, gate):
    """64 requests at once, limit 4, the engine held before its first step: nothing is admitted
    to run, so exactly 4 may wait and exactly 60 must be refused, however their parsing and
    tokenizing interleave. The 4 then complete."""
    limit, burst = 4, 64
    url = make_server(max_waiting_requests=limit)
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": 3, "ignore_eos": True}

    async def run():
        limits = httpx.Limits(max_connections=burst, max_keepalive_connections=burst)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as ac:
            pending = {asyncio.create_task(ac.post("/v1/completions", json=body)) for _ in range(burst)}
            done: set[asyncio.Task] = set()
            while len(done) < burst - limit:
                finished, pending = await asyncio.wait(pending, timeout=30, return_when=asyncio.FIRST_COMPLETED)
                assert finished, f"only {len(done)} of {burst} requests answered while the engine was held"
                done |= finished
            refused = [t.result() for t in done]
            assert len(done) == burst - limit
            # The 4 admitted may still be tokenizing (off the event loop) when the 60th refusal
            # comes back: each reaches the engine, held, soon after.
            wait_until(lambda: engine.num_waiting_requests() == limit, f"{limit} waiting requests")
            gate.set()
            accepted = await asyncio.gather(*pending)
        return refused, accepted

    refused, accepted = asyncio.run(run())
    assert [r.status_code for r in refused] == [429] * (burst - limit)
    assert all(int(r.headers["Retry-After"]) >= 1 and r.json()["error"]["code"] == "rate_limit_exceeded"
               for r in refused)
    assert [(r.status_code, r.json()["usage"]["completion_tokens"]) for r in accepted] == [(200, 3)] * limit


def test_requests_in_the_running_step_do_not_count_as_waiting(make_server, engine, model_gate):
    entered, release = model_gate
    url = make_server(max_waiting_requests=3)
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": 3, "ignore_eos": True}
    with ThreadPoolExecutor(4) as pool:
        running = pool.submit(post, url, "/v1/completions", body)
        # Its step has scheduled it and is held before the model runs: it no longer waits.
        assert entered.wait(timeout=20)
        held = [pool.submit(post, url, "/v1/completions", body) for _ in range(3)]
        wait_until(lambda: engine.num_waiting_requests() == 3, "three waiting requests")
        assert post(url, "/v1/completions", body).status_code == 429
        release.set()
        assert [f.result().status_code for f in [running, *held]] == [200] * 4


@pytest.fixture
def slow_steps(engine, monkeypatch):
    """Steps of >= 10 ms, so that a long request is still running when its client leaves."""
    slow_down_steps(engine.core, monkeypatch, 0.01)


LONG_RUN = 200  # tokens: >= 2 s at >= 10 ms a step, far longer than noticing a disconnect takes


MARKER = "tokenize-me-slowly"


@pytest.mark.parametrize("path,marked", [
    ("/v1/completions", {"prompt": f"hello {MARKER}"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": MARKER}]}),
], ids=["completions", "chat"])
def test_streams_flow_while_a_prompt_is_tokenized(server, engine, gate, slow_steps, monkeypatch, path, marked):
    """The marked prompt's tokenization (a huge prompt's, seconds long) lasts until the test has
    read chunks of another stream. On the event loop it would hold that stream back until the
    hold gives up, and the marked request would fail."""
    tokenizing, tokenized = threading.Event(), threading.Event()
    encode = engine.tokenizer.encode

    def held_encode(text, *args, **kwargs):
        if MARKER in text:
            tokenizing.set()
            if not tokenized.wait(timeout=30):
                raise RuntimeError("no other stream made progress during tokenization")
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(engine.tokenizer, "encode", held_encode)
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": LONG_RUN, "ignore_eos": True,
            "logprobs": 1, "stream": True}  # logprobs: a chunk for every step's token
    with ThreadPoolExecutor(1) as pool, \
            httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200  # accepted; the gate holds its first step
        marked_response = pool.submit(post, server, path, {**marked, "max_tokens": 2})
        assert tokenizing.wait(timeout=30)
        gate.set()  # every chunk from here on flows while the marked prompt is being tokenized
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data:")
            if events == 3:
                break
        tokenized.set()
        assert marked_response.result().status_code == 200


def aborted_count(url: str) -> float:
    return value(scrape(url), "tokenweir:request_success_total", finished_reason="abort")


def test_disconnect_mid_stream_frees_blocks(server, engine, slow_steps):
    before = aborted_count(server)
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": LONG_RUN, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data:")
            if events == 3:
                break  # leaving the block closes the connection mid-stream
    assert_engine_clean(engine)
    assert aborted_count(server) == before + 1


def test_disconnect_while_waiting_for_a_full_response(server, engine, slow_steps):
    before = aborted_count(server)
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": LONG_RUN, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
    assert_engine_clean(engine)
    assert aborted_count(server) == before + 1


def test_disconnect_before_the_first_step(server, engine, gate, slow_steps):
    before = aborted_count(server)
    body = {"model": MODEL, "prompt": "hello world", "max_tokens": LONG_RUN, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200  # accepted, queued behind the held step
    gate.set()
    assert_engine_clean(engine)
    assert aborted_count(server) == before + 1

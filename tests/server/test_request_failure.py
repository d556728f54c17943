"""A request that fails inside the engine, over HTTP: its client gets an OpenAI error, a request
running beside it is untouched, and no KV block is left behind."""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.server.conftest import assert_engine_clean, wait_until
from tests.server.helpers import MODEL, post

DOOMED = "doomed"  # the tenant whose requests fail
BODY = {"model": MODEL, "prompt": "the capital of france is", "max_tokens": 8, "temperature": 1.0,
        "seed": 7, "ignore_eos": True}


@pytest.fixture
def doomed(engine, monkeypatch):
    """Fail the output processing of the doomed tenant's requests at their fourth token, as a
    detokenizer bug would (after some text went out); other requests are processed as usual."""
    processor = engine.core.output_processor
    process_tokens = processor.process_tokens

    def failing(state, *args, **kwargs):
        if state.request.tenant == DOOMED and state.request.num_output_tokens >= 4:
            raise RuntimeError("detokenizer exploded")
        return process_tokens(state, *args, **kwargs)

    monkeypatch.setattr(processor, "process_tokens", failing)


def sse_events(url: str, body: dict[str, Any]) -> tuple[int, list[str]]:
    """Status and the data of every SSE event of a streamed completion."""
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        return r.status_code, [line.removeprefix("data: ") for line in r.iter_lines()
                               if line.startswith("data: ")]


def beside_a_normal_request(url: str, engine, gate, doomed_call: Callable[[], Any]) -> tuple[Any, httpx.Response]:
    """Run the doomed call and a normal request in the same engine steps: the engine is held
    until both wait, so they are scheduled together."""
    with ThreadPoolExecutor(2) as pool:
        bad = pool.submit(doomed_call)
        good = pool.submit(post, url, "/v1/completions", BODY)
        wait_until(lambda: engine.num_waiting_requests() == 2, "both requests to wait")
        gate.set()
        return bad.result(), good.result()


def assert_complete(url: str, response: httpx.Response) -> None:
    """A full answer, identical to the same request made alone afterwards."""
    assert response.status_code == 200, response.text
    out = response.json()
    assert out["usage"]["completion_tokens"] == 8 and out["choices"][0]["finish_reason"] == "length"
    alone = post(url, "/v1/completions", BODY).json()
    assert out["choices"][0]["text"] == alone["choices"][0]["text"]


def assert_internal_error(error: dict[str, Any]) -> None:
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    assert "detokenizer exploded" in error["message"]


def test_non_streamed_failure_is_a_500_with_an_openai_error(server, engine, gate, doomed):
    bad, good = beside_a_normal_request(
        server, engine, gate, lambda: post(server, "/v1/completions", {**BODY, "tenant": DOOMED}))
    assert bad.status_code == 500
    assert_internal_error(bad.json()["error"])
    assert_complete(server, good)
    assert_engine_clean(engine)


def test_streamed_failure_ends_with_an_error_event_then_done(server, engine, gate, doomed):
    (status, events), good = beside_a_normal_request(
        server, engine, gate, lambda: sse_events(server, {**BODY, "tenant": DOOMED}))
    assert status == 200  # the headers went out before the failure
    assert events[-1] == "[DONE]"
    assert_internal_error(json.loads(events[-2])["error"])
    # Text went out before the failure, and no chunk claimed the request finished.
    chunks = [json.loads(e)["choices"][0] for e in events[:-2]]
    assert chunks and "".join(c["text"] for c in chunks)
    assert all(c["finish_reason"] is None for c in chunks)
    assert_complete(server, good)
    assert_engine_clean(engine)

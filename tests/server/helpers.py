"""Small clients and parsers shared by the server tests."""

from __future__ import annotations

import json
import time
from typing import Any, Optional

import httpx
import pytest
import openai
from prometheus_client.parser import text_string_to_metric_families

MODEL = "tiny-llama"
MESSAGES_OK = [{"role": "user", "content": "hello"}]


def client(url: str, api_key: str = "unused") -> openai.OpenAI:
    # No retries: a 429 or 5xx must reach the test, not be retried away.
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=60)


def async_client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


def post(url: str, path: str, body: Any, headers: Optional[dict[str, str]] = None) -> httpx.Response:
    # ASCII JSON (\u escapes, as json.dumps writes it) carries any str, a lone surrogate
    # included, which httpx's UTF-8 JSON cannot encode.
    return httpx.post(f"{url}{path}", content=json.dumps(body), timeout=60,
                      headers={"Content-Type": "application/json", **(headers or {})})


def scrape(url: str, headers: Optional[dict[str, str]] = None) -> dict[tuple[str, frozenset], float]:
    """/metrics as {(sample name, labels): value}."""
    response = httpx.get(f"{url}/metrics", timeout=10, headers=headers)
    response.raise_for_status()
    text = response.text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict[tuple[str, frozenset], float], name: str, **labels: str) -> float:
    return samples.get((name, frozenset({"model_name": MODEL, **labels}.items())), 0.0)


def slow_down_steps(core: Any, monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Make every step of `core` (an EngineCore) take at least `seconds` longer, so that a test
    can act while a request runs or read each output before the next one comes. (The async
    engine runs a step as `schedule()` then `execute()`; the delay comes before scheduling.)"""
    schedule = core.schedule

    def slow_schedule():
        time.sleep(seconds)
        return schedule()

    monkeypatch.setattr(core, "schedule", slow_schedule)


async def cancel_adds_before_their_acks(engine: Any, num_adds: int = 20) -> None:
    """While a request streams, start adds and cancel each before the engine acknowledges it:
    the add and its abort reach the engine loop in one command batch. Then reuse an id."""
    import asyncio
    import contextlib

    from tokenweir.request import SamplingParams

    busy = await engine.add_request("busy", [5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True))
    await busy.__anext__()
    for i in range(num_adds):
        task = asyncio.ensure_future(engine.add_request(f"c{i}", [5, 6], SamplingParams(max_tokens=5)))
        await asyncio.sleep(0)  # submitted; now waiting for its ack
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    await busy.aclose()
    for _ in range(500):  # the aborts' final outputs end the streams
        if not engine._active:
            break
        await asyncio.sleep(0.01)
    assert engine._active == {}, sorted(engine._active)
    reused = await engine.add_request("c0", [5, 6], SamplingParams(max_tokens=2))
    assert [o async for o in reused][-1].finished

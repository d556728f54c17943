"""`--low-priority-kv-cache-dtype int8` over the OpenAI API: a request's `priority` decides its
K/V dtype. A priority-0 request gets the same tokens and logprobs as from an engine without the
flag; a priority-1 one is served from int8 K/V (its logprobs move, a little); the gauge counts it."""

from __future__ import annotations

import threading

from tests.server.conftest import ServerThread, assert_engine_clean, make_engine
from tests.server.helpers import MODEL, client, scrape, slow_down_steps, value
from tokenweir.server.app import build_app

PROMPT = "the quick brown fox jumps over the lazy dog and then"


def _complete(url: str, priority: int) -> tuple[str, list[float]]:
    out = client(url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.0, logprobs=0,
                                         extra_body={"priority": priority, "ignore_eos": True})
    return out.choices[0].text, out.choices[0].logprobs.token_logprobs


def test_priority_decides_the_kv_dtype(server, tiny_model_dir, monkeypatch):
    plain_text, plain_logprobs = _complete(server, 0)  # the session's engine: no int8
    engine = make_engine(tiny_model_dir("llama"), low_priority_kv_cache_dtype="int8")
    slow_down_steps(engine.core, monkeypatch, 0.02)  # 12 steps of 20 ms: the watcher sees them
    int8_server = ServerThread(build_app(engine))
    try:
        seen: list[float] = []
        stop = threading.Event()

        def watch() -> None:  # the gauge while the low-priority request runs
            while not stop.is_set():
                seen.append(value(scrape(int8_server.url), "tokenweir:num_requests_running_kv_int8",
                                  model_name=MODEL))

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            high_text, high_logprobs = _complete(int8_server.url, 0)
            low_text, low_logprobs = _complete(int8_server.url, 1)
        finally:
            stop.set()
            watcher.join()
        assert (high_text, high_logprobs) == (plain_text, plain_logprobs)
        assert low_logprobs != plain_logprobs
        assert abs(low_logprobs[0] - plain_logprobs[0]) < 0.05  # the first token: the same context
        assert max(seen) == 1.0
    finally:
        int8_server.stop()
        assert_engine_clean(engine)
        engine.shutdown()

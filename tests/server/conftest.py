"""A real uvicorn server on 127.0.0.1 around an AsyncLLMEngine on a tiny random Llama
(`tiny_model_dir` comes from tests/conftest.py).

One engine serves the whole session (loading is the slow part); each test starts its own app
and server on a free port, and leaves the engine idle with every KV block free.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import uvicorn

from tests.engine.helpers import assert_async_engine_released
from tokenweir.config import EngineArgs
from tokenweir.engine.async_engine import AsyncLLMEngine
from tokenweir.server.app import build_app

NUM_BLOCKS = 96
BLOCK_SIZE = 16
MAX_MODEL_LEN = 256


def make_engine(model_dir: str, **overrides: Any) -> AsyncLLMEngine:
    args = dict(model=model_dir, dtype="float32", device="cpu", num_gpu_blocks_override=NUM_BLOCKS,
                block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, served_model_name="tiny-llama",
                disable_log_stats=True)
    return AsyncLLMEngine.from_engine_args(EngineArgs(**{**args, **overrides}))


@pytest.fixture(scope="session")
def engine(tiny_model_dir: Callable[[str], str]) -> Iterator[AsyncLLMEngine]:
    eng = make_engine(tiny_model_dir("llama"))
    yield eng
    eng.shutdown()


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def assert_engine_clean(engine: AsyncLLMEngine) -> None:
    """Wait for the engine to go idle, then check nothing leaked (its thread is blocked on its
    command queue by then, so reading the scheduler is safe)."""
    wait_until(lambda: engine.num_unfinished_requests() == 0, "the engine to go idle")
    assert_async_engine_released(engine)


class ServerThread:
    def __init__(self, app: Any) -> None:
        # Bind first and hand uvicorn the socket, so the free port cannot be taken in between.
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, "the server to start", timeout_s=10)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture
def make_server(engine: AsyncLLMEngine) -> Iterator[Callable[..., str]]:
    """make_server(api_key=..., max_waiting_requests=...) -> base URL of a fresh server."""
    servers: list[ServerThread] = []

    def start(eng: AsyncLLMEngine = engine, **app_kwargs: Any) -> str:
        servers.append(ServerThread(build_app(eng, **app_kwargs)))
        return servers[-1].url

    yield start
    for srv in servers:
        srv.stop()
    assert_engine_clean(engine)


@pytest.fixture
def server(make_server: Callable[..., str]) -> str:
    return make_server()


def hold_calls(obj: Any, name: str, monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Make each call of `obj.name` wait until the second event (release) is set; the first
    (entered) is set once a call waits."""
    entered, release = threading.Event(), threading.Event()
    fn = getattr(obj, name)

    def held(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        release.wait()
        return fn(*args, **kwargs)

    monkeypatch.setattr(obj, name, held)
    return entered, release


@pytest.fixture
def gate(engine: AsyncLLMEngine, make_server: Callable[..., str],
         monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Hold the engine before each step until the test sets the event: requests queue up
    deterministically, whatever the machine's speed. (It depends on make_server so that it
    opens before the servers' leak check runs.)"""
    _, release = hold_calls(engine.core, "schedule", monkeypatch)
    yield release
    release.set()


@pytest.fixture
def model_gate(engine: AsyncLLMEngine, make_server: Callable[..., str],
               monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, threading.Event]]:
    """(entered, release): hold each step after it has scheduled, before the model runs, until
    the test sets `release`; `entered` tells that a step is held. (After make_server, as gate.)"""
    entered, release = hold_calls(engine.core.runner, "execute_model", monkeypatch)
    yield entered, release
    release.set()

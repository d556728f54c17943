"""`tokenweir serve` as a user starts it: a subprocess with the default model (no --model),
answering the official openai client."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai

READY_TIMEOUT_S = 120  # loads (and on a first run converts) the embedded default model


def free_port() -> int:
    # Free when we look; the server binds it a moment later, a race a test can live with.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """The processes `pid` started (Linux /proc), leaving out multiprocessing's resource tracker."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"resource_tracker" not in cmdline:
                found.append(int(child))
    return found


def wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(0.2)
    raise AssertionError(f"no /health within {READY_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def test_serve_default_model_answers_a_chat_completion(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    # A small KV pool and context keep the start fast and light.
    command = [sys.executable, "-m", "tokenweir.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--kv-cache-memory", "64MiB", "--max-model-len", "512", "--uvicorn-log-level", "warning"]
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, proc, log)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        (model,) = [m.id for m in client.models.list().data]
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=8, temperature=0)
        assert reply.choices[0].message.role == "assistant"
        assert reply.choices[0].message.content.strip()
        usage = reply.usage
        assert usage.prompt_tokens > 0 and 1 <= usage.completion_tokens <= 8
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        # The default dtype (bf16 here) through greedy, min_tokens, logprobs and a stream.
        held = client.completions.create(model=model, prompt="Hi", max_tokens=6, temperature=0,
                                         extra_body={"min_tokens": 6})
        assert held.usage.completion_tokens == 6
        chunks = list(client.completions.create(model=model, prompt="Name a colour:", max_tokens=5,
                                                temperature=0.5, seed=1, logprobs=2, stream=True))
        assert all(c.choices[0].logprobs is not None for c in chunks if c.choices)
        # Work before rejection is bounded: a prompt that cannot fit is refused on its length
        # in characters, before tokenizing; a body over the default limit before parsing.
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "x" * 2_000_000}, timeout=60)
        assert refused.status_code == 400 and "at least" in refused.json()["error"]["message"]
        too_big = httpx.post(f"{url}/v1/completions", json={"prompt": "x" * 5_000_000}, timeout=60)
        assert too_big.status_code == 413
        # The engine runs in a process of its own, which ends with the server (SIGTERM).
        engine_pids = child_pids(proc.pid)
        assert len(engine_pids) == 1, engine_pids
        proc.terminate()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{engine_pids[0]}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not Path(f"/proc/{engine_pids[0]}").exists(), "the engine process outlived the server"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

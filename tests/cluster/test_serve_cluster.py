"""`tokenweir serve --data-parallel-size 2` as a user starts it: the official openai client over a
real socket, both replicas killed mid-stream (real SIGKILL), the stream completed with exactly
the text an undisturbed one gets, and Ray's processes gone after the server stops."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import openai
import psutil

from tests.server.test_serve_cli import free_port, wait_healthy


def replica_processes(server: psutil.Process) -> list[psutil.Process]:
    return [p for p in server.children(recursive=True) if "EngineReplica" in " ".join(p.cmdline())]


def test_serve_data_parallel_survives_its_replicas_dying_mid_stream(tmp_path, tiny_model_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "tokenweir.cli", "serve", "--model", tiny_model_dir("llama"),
               "--dtype", "float32", "--num-gpu-blocks-override", "96", "--max-model-len", "256",
               "--host", "127.0.0.1", "--port", str(port), "--uvicorn-log-level", "warning",
               "--data-parallel-size", "2", "--routing-policy", "least_loaded", "--served-model-name", "tiny-llama"]
    with open(log, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    server = psutil.Process(proc.pid)
    try:
        wait_healthy(url, proc, log)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        body = dict(model="tiny-llama", prompt=[5, 9, 17, 33, 8, 41, 12], max_tokens=60, temperature=0.0,
                    extra_body={"ignore_eos": True})
        expected = client.completions.create(**body).choices[0].text
        replicas = replica_processes(server)
        assert len(replicas) == 2, replicas
        pieces = []
        for i, chunk in enumerate(client.completions.create(stream=True, **body)):
            pieces.append(chunk.choices[0].text)
            if i == 5:
                for p in replicas:
                    p.send_signal(signal.SIGKILL)
        assert "".join(pieces) == expected
        assert not any(p.is_running() for p in replicas)
        assert client.models.list().data[0].id
        descendants = server.children(recursive=True)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    deadline = time.monotonic() + 30
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in descendants):
        assert time.monotonic() < deadline, [p for p in descendants if p.is_running()]
        time.sleep(0.2)
    assert "replica 0 lost" in log.read_text() or "replica 1 lost" in log.read_text(), log.read_text()[-2000:]

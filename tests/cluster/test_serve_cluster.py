"""`tokenweir serve --data-parallel-size 2` as a user starts it: the official openai client over a
real socket, both replicas killed mid-stream (real SIGKILL), the stream completed with exactly
the text an undisturbed one gets, and Ray's processes gone after the server stops; the same on
a Ray cluster started apart (`ray start`) and joined with --ray-address, which outlives the
server."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import openai
import psutil
import pytest

from tests.server.test_serve_cli import free_port, wait_healthy
from tokenweir.cluster import RAY_ENV


def replica_processes(root: psutil.Process) -> list[psutil.Process]:
    return [p for p in root.children(recursive=True) if "EngineReplica" in " ".join(p.cmdline())]


def wait_gone(processes: list[psutil.Process], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in processes):
        assert time.monotonic() < deadline, [p for p in processes if p.is_running()]
        time.sleep(0.2)


def serve_command(model_dir: str, port: int, *flags: str) -> list[str]:
    return [sys.executable, "-m", "tokenweir.cli", "serve", "--model", model_dir,
            "--dtype", "float32", "--num-gpu-blocks-override", "96", "--max-model-len", "256",
            "--host", "127.0.0.1", "--port", str(port), "--uvicorn-log-level", "warning",
            "--data-parallel-size", "2", "--routing-policy", "least_loaded", "--served-model-name", "tiny-llama",
            *flags]


def serve_and_kill_replicas_mid_stream(tmp_path: Path, model_dir: str, replicas_under: Callable[[psutil.Process], psutil.Process],
                                       *flags: str, env: Optional[dict[str, str]] = None) -> tuple[str, list[psutil.Process]]:
    """Serves with `flags`, streams a greedy completion while SIGKILLing both replicas (found
    under the process `replicas_under(server)` gives) after its sixth chunk, and checks it
    against the same request undisturbed. (The server's log, its descendants) after it stopped."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(serve_command(model_dir, port, *flags), stdout=out, stderr=subprocess.STDOUT, env=env)
    server = psutil.Process(proc.pid)
    try:
        wait_healthy(url, proc, log)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        body = dict(model="tiny-llama", prompt=[5, 9, 17, 33, 8, 41, 12], max_tokens=60, temperature=0.0,
                    extra_body={"ignore_eos": True})
        expected = client.completions.create(**body).choices[0].text
        replicas = replica_processes(replicas_under(server))
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
        assert stop(proc, signal.SIGINT), "the server did not exit within 60 s of SIGINT"
    text = log.read_text()
    assert "replica 0 lost" in text or "replica 1 lost" in text, text[-2000:]
    return text, descendants


def test_serve_data_parallel_survives_its_replicas_dying_mid_stream(tmp_path, tiny_model_dir):
    _, descendants = serve_and_kill_replicas_mid_stream(tmp_path, tiny_model_dir("llama"), lambda server: server)
    wait_gone(descendants)


# Ray's token authentication, as a user turns it on for a cluster: where its token file is, and
# the variables of a driver that must use it (none inherited from the machine running the tests).
RAY_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")


def ray_driver_env(token_path: str, **extra: str) -> dict[str, str]:
    """The environment of a process on this machine with a cluster's token at hand, its auth
    mode left to `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in RAY_AUTH_VARS}
    return {**env, "RAY_AUTH_TOKEN_PATH": token_path, **extra}


@dataclass(frozen=True)
class RayHead:
    process: psutil.Process
    address: str
    token_path: str

    def driver_env(self, **extra: str) -> dict[str, str]:
        return ray_driver_env(self.token_path, **extra)


def stop(proc: subprocess.Popen, sig: int) -> bool:
    """Sends `sig`, and SIGKILLs the process if it has not exited within 60 s; whether it exited
    by itself."""
    proc.send_signal(sig)
    try:
        proc.wait(timeout=60)
        return True
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
        return False


@pytest.fixture
def ray_head() -> Iterator[RayHead]:
    """A one-node Ray cluster on loopback started as a user starts one (`ray start --head`) with
    token authentication on (its own token, so nothing in ~/.ray is read or written), in a
    session of its own and a temp dir of its own (its address file must not send another
    ray.init on this machine to it once it is gone). Stopped by its PID: the head stops its
    processes, and each raylet its workers; then its process group, for anything of the head's
    own left behind."""
    temp_dir = tempfile.mkdtemp(prefix="tw-ray-", dir="/tmp")  # short: Ray's socket paths live under it
    port = free_port()
    log = Path(temp_dir) / "head.log"
    token_path = Path(temp_dir) / "auth_token"
    token_path.write_text(secrets.token_hex(32))
    with open(log, "w") as out:
        head = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head", "--block",
                                 f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=2",
                                 "--include-dashboard=false", f"--temp-dir={temp_dir}"],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**ray_driver_env(str(token_path), RAY_AUTH_MODE="token"), **RAY_ENV})
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log.read_text():
            assert head.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        yield RayHead(psutil.Process(head.pid), f"127.0.0.1:{port}", str(token_path))
    finally:
        stop(head, signal.SIGTERM)
        try:
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_without_an_address_the_server_starts_a_ray_of_its_own_beside_another(ray_head):
    """RAY_ADDRESS (or the address file `ray start` leaves) would make a bare ray.init join that
    cluster, and refuse the local one's num_cpus there: the server would not start."""
    address = ray_head.address
    script = ("import ray\n"
              "from tokenweir.cluster.config import ClusterConfig\n"
              "from tokenweir.cluster.coordinator import start_ray\n"
              "assert start_ray(ClusterConfig(data_parallel_size=2))\n"
              "print(ray.get_runtime_context().gcs_address)\n"
              "ray.shutdown()\n")
    done = subprocess.run([sys.executable, "-c", script], env={**ray_head.driver_env(), "RAY_ADDRESS": address},
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    own = done.stdout.strip().splitlines()[-1]
    assert own.startswith("127.0.0.1:") and own != address


def test_serve_joins_a_ray_cluster_with_ray_address_and_leaves_it_running(tmp_path, tiny_model_dir, ray_head):
    """The replicas run on the cluster (under its raylet, not the server), a replica failover
    there keeps the stream exact (the replicas' clocks are not the server's: no times carried
    over), and the server's exit takes its replicas down but not the cluster."""
    head, address = ray_head.process, ray_head.address
    # The cluster checks tokens: a driver joining it by address sends none unless told to
    # (RAY_AUTH_MODE=token, as Ray's docs say); without it the server says so, and exits.
    refused = subprocess.run(serve_command(tiny_model_dir("llama"), free_port(), "--ray-address", address),
                             env=ray_head.driver_env(), capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and "refused this one" in refused.stderr \
        and "Set RAY_AUTH_MODE=token" in refused.stderr, refused.stderr[-3000:]
    serve_and_kill_replicas_mid_stream(tmp_path, tiny_model_dir("llama"), lambda server: head,
                                       "--ray-address", address, env=ray_head.driver_env(RAY_AUTH_MODE="token"))
    wait_gone(replica_processes(head))
    assert head.is_running() and head.status() != psutil.STATUS_ZOMBIE
    raylets = [p for p in head.children(recursive=True) if "raylet" in p.name()]
    assert raylets and all(p.is_running() for p in raylets)


def test_only_a_refused_token_gets_the_token_advice():
    """A wrong address or a cluster that is down must not send the user after tokens."""
    from ray.exceptions import AuthenticationError

    from tokenweir.cluster.coordinator import token_refusal

    def failed_join(cause: BaseException) -> ConnectionError:
        try:
            try:
                raise cause
            except BaseException as e:
                raise ConnectionError("Failed to connect to Ray cluster at 127.0.0.1:1") from e
        except ConnectionError as e:
            return e

    refusal = AuthenticationError("RPC error: InvalidAuthToken: Authentication token is missing or incorrect")
    assert token_refusal(failed_join(refusal)) is refusal
    assert token_refusal(failed_join(RuntimeError("No node info found matching attributes"))) is None
    assert token_refusal(ConnectionError("Could not find any running Ray instance")) is None

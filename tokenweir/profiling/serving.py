"""`tokenweir profile --serving`: fit the cost model to `tokenweir serve`'s own step times.

On a machine where the server, its event loop and its clients share a few cores, a step of the
serving engine takes longer than the same step run alone: outputs are handed to the event
loop, streamed, parsed by the clients, all on the cores the model wants. The simulator of
`serve` must advance by that time. So this profile starts `tokenweir serve --step-trace` with
the given engine flags, loads it with `bench serve`'s streaming client over loopback (random
prompts and outputs, at concurrency levels from 1 to 64, so every batch size and mix of
prefill and decode occurs), and fits the cost model to the recorded steps: each step's
composition and the engine loop's real period.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from tokenweir.config import EngineArgs
from tokenweir.core.cost_model import StepComposition
from tokenweir.profiling.measure import StepSample, measure_copy_bandwidth

# (client concurrency, requests, request rate) per phase of the load; prompts of 20-780 tokens,
# outputs of 5-187. Closed-loop phases hold decode batches near their concurrency; open-loop
# (Poisson) phases send prompts into running batches, as real traffic does, so that large
# mixed steps (a whole prompt next to tens of decodes) are measured too.
PHASES = ((1, 4, None), (2, 6, None), (4, 10, None), (8, 16, None), (16, 28, None), (32, 44, None),
          (64, 76, None), (None, 24, 0.5), (None, 40, 1.5))
INPUT_LEN, OUTPUT_LEN, RANGE_RATIO = 400, 96, 0.95
# A first look (and the tests, on tiny models): two short phases of short requests.
QUICK_PHASES = ((1, 2, None), (None, 6, 4.0))
QUICK_INPUT_LEN, QUICK_OUTPUT_LEN = 24, 12
# The server's first steps pay for lazy kernel builds and allocator growth.
WARMUP_STEPS = 8


def region_of(comp: StepComposition) -> str:
    if not comp.num_prefill_tokens:
        return "decode"
    return "prefill" if not comp.num_decode_seqs else "mixed"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, server: subprocess.Popen, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the profiled server exited with status {server.returncode}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the profiled server did not answer {url}/health within {timeout_s:.0f} s")


def _load(base_url: str, quick: bool, tokenizer: str) -> None:
    from tokenweir.bench import serve as bench

    parser = argparse.ArgumentParser()
    bench.add_cli_args(parser)
    phases = QUICK_PHASES if quick else PHASES
    input_len, output_len = (QUICK_INPUT_LEN, QUICK_OUTPUT_LEN) if quick else (INPUT_LEN, OUTPUT_LEN)
    for i, (concurrency, num, rate) in enumerate(phases):
        load = f"concurrency {concurrency}" if concurrency else f"{rate} req/s"
        print(f"serving profile: {num} requests at {load}", file=sys.stderr)
        shape = ["--max-concurrency", str(concurrency)] if concurrency else ["--request-rate", str(rate)]
        ns = parser.parse_args([
            "--base-url", base_url, "--dataset-name", "random", "--num-prompts", str(num),
            "--random-input-len", str(input_len), "--random-output-len", str(output_len),
            "--random-range-ratio", str(RANGE_RATIO), *shape,
            "--ignore-eos", "--seed", str(1000 + i), "--tokenizer", tokenizer])
        result = bench.main(ns)
        if result["failed"]:
            raise RuntimeError(f"the profiled server failed {result['failed']} requests: {result['errors'][:3]}")


def profile_serving(args: EngineArgs, quick: bool = False) -> tuple[dict, str]:
    import torch

    from tokenweir.cli import engine_argv
    from tokenweir.engine.step_trace import read_step_trace
    from tokenweir.profiling.profile import fit_profile, utc_now

    work = Path(tempfile.mkdtemp(prefix="tokenweir-profile-"))
    trace = work / "steps.jsonl"
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [sys.executable, "-m", "tokenweir.cli", "serve", "--port", str(port), "--step-trace", str(trace),
         "--disable-log-stats", "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning",
         *engine_argv(dataclasses.replace(args, disable_log_stats=False))],
        env={**os.environ})
    start = time.perf_counter()
    try:
        wait_healthy(base_url, server)
        # The server wrote what it built (model, dtype, device, KV pool) before it answered.
        engine, _ = read_step_trace(trace)
        _load(base_url, quick, engine["model_path"])
    finally:
        server.terminate()
        server.wait(timeout=120)
    engine, steps = read_step_trace(trace)
    samples = [StepSample(comp, seconds, region_of(comp)) for comp, seconds in steps[WARMUP_STEPS:]]
    if len(samples) < 10:
        raise RuntimeError(f"the serving profile recorded only {len(samples)} steps")
    # Copies between device and host blocks, timed here on the server's device (bytes are bytes:
    # a block of the server's size in uint8).
    device = torch.device(engine["device"])
    blocks = torch.zeros((2, 128, engine["kv_bytes_per_block"] // 2), dtype=torch.uint8, device=device)
    # `serve`'s engine process keeps torch's threads for every step (only --engine-in-process
    # gives up a core for small steps): no small-step term.
    metadata = {**engine, "serving_threads": False, "measured_at": utc_now(),
                "source": "tokenweir serve step trace under bench-serve load",
                "load_phases": [list(p) for p in (QUICK_PHASES if quick else PHASES)],
                "profile_seconds": round(time.perf_counter() - start, 1)}
    return fit_profile(samples, measure_copy_bandwidth([blocks]), metadata, 0)

"""The serving path's own cost: offline per-token time vs server TPOT, side by side in one run.

One run measures, interleaved round by round so that load from other processes on the shared
cores hits every variant alike:
  - offline: one request (--input-len prompt ids, --output-len new tokens, ignore_eos) through
    LLM.generate's loop (EngineCore add + step), per-token time = mean decode step time;
  - for each server variant: TPOT of one stream (vLLM's definition: (latency - TTFT) /
    (tokens - 1)), and output tok/s of --num-prompts requests at --streams concurrent streams.
Every server and the offline worker stay loaded for the whole run; each round measures each of
them once, in turn. Medians over the rounds and the ratios server TPOT / offline per-token
time are printed and written to docs/benchmarks/serving_path.{json,md}.

A variant is NAME=ROOT[,KEY=VAL...][,--FLAG...]: the server runs `tokenweir serve` from the
checkout ROOT (PYTHONPATH=ROOT) with the extra environment variables and serve flags; the offline
worker runs from the first variant's ROOT.

    .venv/bin/python benchmarks/serving_path.py --variant main=/work/main --variant this=.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import aiohttp
import httpx

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks"
VOCAB_LOW, VOCAB_HIGH = 100, 40_000  # plain tokens of the default model's vocabulary

# Runs in the offline worker: one line on stdin -> one JSON line on stdout.
_OFFLINE_WORKER = r"""
import json, random, statistics, sys, time
from tokenweir.engine.llm import LLM
from tokenweir.machine import cpu_name
from tokenweir.request import SamplingParams
input_len, output_len = int(sys.argv[1]), int(sys.argv[2])
core = LLM(disable_log_stats=True).engine
def run(seed, n):
    # LLM.generate's loop (add, then step until done), timing each step.
    ids = random.Random(seed).choices(range(%d, %d), k=input_len)
    core.add_request(str(seed), ids, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
    times = []
    while core.has_unfinished_requests():
        t = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t)
    return times[1:]  # the decode steps
run(0, 4)  # warm-up
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    steps = run(int(line), output_len)
    print(json.dumps({"per_token_s": statistics.mean(steps), "median_step_s": statistics.median(steps)}), flush=True)
""" % (VOCAB_LOW, VOCAB_HIGH)


@dataclass
class Variant:
    name: str
    root: Path
    env: dict[str, str]
    flags: list[str] = field(default_factory=list)
    port: int = 0
    proc: Optional[subprocess.Popen] = None
    model: str = ""
    tpot_1_s: list[float] = field(default_factory=list)
    tok_s_n: list[float] = field(default_factory=list)


def parse_variant(text: str) -> Variant:
    name, _, rest = text.partition("=")
    root, *items = rest.split(",")
    flags = [item for item in items if item.startswith("--")]
    env_items = [item for item in items if not item.startswith("--")]
    if not name or not root or not all("=" in kv for kv in env_items):
        raise argparse.ArgumentTypeError(f"expected NAME=ROOT[,KEY=VAL...][,--FLAG...], got {text!r}")
    env = dict(kv.split("=", 1) for kv in env_items)
    return Variant(name, Path(root).resolve(), env, flags)


def child_env(root: Path, extra: dict[str, str]) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(root), **extra}


def load() -> list[float]:
    return list(os.getloadavg())


def start_server(v: Variant, log_dir: Path) -> None:
    log = open(log_dir / f"serving_path-{v.name}.log", "w")
    cmd = [sys.executable, "-m", "tokenweir.cli", "serve", "--port", str(v.port), "--disable-log-stats",
           "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning", *v.flags]
    v.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=v.root,
                              env=child_env(v.root, v.env))


def wait_ready(v: Variant, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert v.proc is not None
        if v.proc.poll() is not None:
            raise RuntimeError(f"server {v.name} exited with code {v.proc.returncode}")
        try:
            r = httpx.get(f"http://127.0.0.1:{v.port}/v1/models", timeout=5)
            if r.status_code == 200:
                v.model = r.json()["data"][0]["id"]
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"server {v.name} did not answer within {timeout_s} s")


async def one_stream(session: aiohttp.ClientSession, v: Variant, ids: list[int], output_len: int) -> tuple[float, int]:
    """(TPOT in seconds, tokens) of one streamed completion."""
    body = {"model": v.model, "prompt": ids, "max_tokens": output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft: Optional[float] = None
    tokens = 0
    async with session.post(f"http://127.0.0.1:{v.port}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and ttft is None:
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    latency = time.perf_counter() - start
    if tokens != output_len or ttft is None:
        raise RuntimeError(f"{v.name}: got {tokens} tokens, wanted {output_len}")
    return (latency - ttft) / (tokens - 1), tokens


def prompts(seed: int, n: int, input_len: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [rng.choices(range(VOCAB_LOW, VOCAB_HIGH), k=input_len) for _ in range(n)]


async def single(v: Variant, seed: int, ns: argparse.Namespace) -> float:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as s:
        return (await one_stream(s, v, prompts(seed, 1, ns.input_len)[0], ns.output_len))[0]


async def concurrent(v: Variant, seed: int, ns: argparse.Namespace) -> float:
    sem = asyncio.Semaphore(ns.streams)
    conn = aiohttp.TCPConnector(limit=ns.streams)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=3600)) as s:
        async def go(ids: list[int]) -> int:
            async with sem:
                return (await one_stream(s, v, ids, ns.output_len))[1]
        start = time.perf_counter()
        counts = await asyncio.gather(*(go(ids) for ids in prompts(seed, ns.num_prompts, ns.input_len)))
        return sum(counts) / (time.perf_counter() - start)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", type=parse_variant, action="append",
                   help="NAME=ROOT[,KEY=VAL...] (repeatable; default: this checkout)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--skip-concurrent", action="store_true", help="only offline and one stream")
    p.add_argument("--base-port", type=int, default=8310)
    p.add_argument("--name", default="serving_path", help="output file stem in docs/benchmarks")
    p.add_argument("--offline-threads", type=lambda t: [int(x) for x in t.split(",")], default=[0],
                   help="comma-separated torch thread counts for offline workers, each measured "
                        "every round (0 = torch's default); the first is the ratios' reference")
    ns = p.parse_args()
    variants: list[Variant] = ns.variant or [Variant("this", ROOT, {})]
    for i, v in enumerate(variants):
        v.port = ns.base_port + i
    load_start = load()
    offline_workers = {
        threads: subprocess.Popen([sys.executable, "-c", _OFFLINE_WORKER, str(ns.input_len), str(ns.output_len)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=variants[0].root,
                                  env=child_env(variants[0].root, {"OMP_NUM_THREADS": str(threads)} if threads else {}))
        for threads in ns.offline_threads}
    try:
        for worker in offline_workers.values():
            assert worker.stdout is not None
            if "ready" not in json.loads(worker.stdout.readline()):
                raise RuntimeError("offline worker failed")
        for v in variants:  # one at a time: loading competes for the cores
            start_server(v, Path(tempfile.gettempdir()))
            wait_ready(v)
            asyncio.run(single(v, 99, ns))  # warm-up
        offline_by_threads: dict[int, list[float]] = {threads: [] for threads in offline_workers}
        offline_s = offline_by_threads[ns.offline_threads[0]]
        for r in range(ns.rounds):
            for threads, worker in offline_workers.items():
                assert worker.stdin is not None and worker.stdout is not None
                worker.stdin.write(f"{1000 + r}\n")
                worker.stdin.flush()
                offline_by_threads[threads].append(json.loads(worker.stdout.readline())["per_token_s"])
            for v in variants:
                v.tpot_1_s.append(asyncio.run(single(v, 2000 + r, ns)))
            if not ns.skip_concurrent:
                for v in variants:
                    v.tok_s_n.append(asyncio.run(concurrent(v, 3000 + r, ns)))
            print(f"round {r}: offline {offline_s[-1] * 1e3:.2f} ms/token; "
                  + "; ".join(f"{v.name} TPOT {v.tpot_1_s[-1] * 1e3:.2f} ms"
                              + (f", {v.tok_s_n[-1]:.0f} tok/s at {ns.streams}" if v.tok_s_n else "")
                              for v in variants), flush=True)
    finally:
        for worker in offline_workers.values():
            worker.kill()
        for v in variants:
            if v.proc is not None:
                v.proc.terminate()
                v.proc.wait(30)
    off = median(offline_s)
    result = {
        "machine": {"cpus": os.cpu_count(), "processor": cpu_name(),
                    "python": platform.python_version()},
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load_avg_start": load_start, "load_avg_end": load(),
        "input_len": ns.input_len, "output_len": ns.output_len, "streams": ns.streams,
        "num_prompts": ns.num_prompts, "rounds": ns.rounds,
        "offline_per_token_ms": [x * 1e3 for x in offline_s], "offline_per_token_ms_median": off * 1e3,
        "offline_threads": ns.offline_threads,
        "offline_per_token_ms_median_by_threads": {str(t or "default"): median(xs) * 1e3
                                                   for t, xs in offline_by_threads.items()},
        "variants": {v.name: {"root": str(v.root), "env": v.env, "flags": v.flags,
                              "tpot_1_ms": [x * 1e3 for x in v.tpot_1_s],
                              "tpot_1_ms_median": median(v.tpot_1_s) * 1e3,
                              "tpot_1_over_offline": median(v.tpot_1_s) / off,
                              "output_tok_s": v.tok_s_n, "output_tok_s_median": median(v.tok_s_n)}
                     for v in variants},
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"{ns.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    (OUT / f"{ns.name}.md").write_text(md)
    print(md)


def markdown(r: dict) -> str:
    lines = [f"# Serving path cost ({r['date']})", "",
             f"Machine: {r['machine']['cpus']} CPUs ({r['machine']['processor']}), Python {r['machine']['python']}; "
             f"load average at start {r['load_avg_start'][0]:.2f}, at end {r['load_avg_end'][0]:.2f}.",
             f"Command: `{r['command']}`", "",
             f"One request: {r['input_len']}-token prompt, {r['output_len']} new tokens (ignore_eos), default model. "
             f"Medians of {r['rounds']} rounds, variants measured in turn within each round.", "",
             f"Offline `LLM.generate` per-token time: **{r['offline_per_token_ms_median']:.2f} ms**"
             + "".join(f"; with {t} torch threads {ms:.2f} ms"
                       for t, ms in r["offline_per_token_ms_median_by_threads"].items() if t != "default"), "",
             f"| variant | TPOT, 1 stream (ms) | TPOT / offline | output tok/s at {r['streams']} streams |",
             "|---|---|---|---|"]
    for name, v in r["variants"].items():
        lines.append(f"| {name} | {v['tpot_1_ms_median']:.2f} | {v['tpot_1_over_offline']:.2f}x | "
                     f"{v['output_tok_s_median']:.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

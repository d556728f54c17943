"""CPU cost of one scheduler step: schedule() + update_from_output(), no model.

Scenarios: 256 running decodes with 10,000 requests waiting behind the max_num_seqs cap, and
1,024 running decodes. Also the cost of one prefix-cache block key (BLAKE2b over the canonical
encoding) beside the 64-bit tuple hash it replaced. Writes docs/benchmarks/scheduler.md (+ .json)
with the per-step time and the top of a cProfile of the same loop.

    .venv/bin/python benchmarks/scheduler_overhead.py [--steps 2000]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import time
from pathlib import Path

from tokenweir.config import CacheConfig, SchedulerConfig
from tokenweir.core.block_hash import BlockHasher
from tokenweir.core.scheduler import Scheduler
from tokenweir.request import Request, SamplingParams

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"


def build(num_running: int, num_waiting: int, prompt_len: int = 128) -> Scheduler:
    block_size = 16
    blocks_per_req = (prompt_len + 4096) // block_size + 1  # room to decode for a long time
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=max(2048, num_running), max_num_seqs=num_running),
        CacheConfig(block_size=block_size, num_blocks=num_running * blocks_per_req))
    params = SamplingParams(max_tokens=None, ignore_eos=True)
    for i in range(num_running + num_waiting):
        prompt = [(i * 7 + j) % 50000 for j in range(prompt_len)]
        sched.add_request(Request(f"req-{i}", prompt, params, arrival_time=float(i), eos_token_id=2))
    # Prefill everything that can run, until all running requests decode one token per step.
    while True:
        out = sched.schedule()
        sched.update_from_output(out, {rid: [5] for rid in out.num_scheduled_tokens})
        if len(out.num_scheduled_tokens) == num_running and out.total_num_scheduled_tokens == num_running:
            return sched


def run_steps(sched: Scheduler, steps: int) -> None:
    for _ in range(steps):
        out = sched.schedule()
        sched.update_from_output(out, {rid: [7] for rid in out.num_scheduled_tokens})


def measure(num_running: int, num_waiting: int, steps: int) -> dict:
    sched = build(num_running, num_waiting)
    run_steps(sched, 50)  # warm up
    start = time.process_time()
    run_steps(sched, steps)
    per_step_ms = (time.process_time() - start) / steps * 1e3
    profiler = cProfile.Profile()
    profiler.enable()
    run_steps(sched, min(steps, 500))
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(8)
    top = "\n".join(line for line in text.getvalue().splitlines() if line.strip())
    top = top[top.index("ncalls"):] if "ncalls" in top else top
    return {"num_running": num_running, "num_waiting": num_waiting, "steps": steps,
            "cpu_ms_per_step": round(per_step_ms, 4),
            "us_per_running_request": round(per_step_ms * 1e3 / num_running, 3), "profile_top": top}


def measure_hashing(num_blocks: int = 100_000, block_size: int = 16) -> dict:
    """CPU time per block key: the keyed BLAKE2b of core/block_hash.py vs Python's tuple hash."""
    blocks = [[(i * 31 + j) % 50000 for j in range(block_size)] for i in range(num_blocks)]
    hasher = BlockHasher(b"deployment-key")
    start = time.process_time()
    parent = hasher.root()
    for tokens in blocks:
        parent = hasher.hash_block(parent, tokens)
    blake_us = (time.process_time() - start) / num_blocks * 1e6
    start = time.process_time()
    old = 0
    for tokens in blocks:
        old = hash((old, tuple(tokens)))
    tuple_us = (time.process_time() - start) / num_blocks * 1e6
    return {"block_size": block_size, "blocks": num_blocks, "blake2b_us_per_block": round(blake_us, 3),
            "tuple_hash_us_per_block": round(tuple_us, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    results = [measure(256, 10_000, args.steps), measure(1024, 0, args.steps // 2)]
    hashing = measure_hashing()
    machine = f"{platform.processor() or platform.machine()}, {platform.python_implementation()} {platform.python_version()}"
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "scheduler.json").write_text(json.dumps({"machine": machine, "results": results, "hashing": hashing}, indent=2))
    lines = ["# Scheduler overhead", "",
             "CPU time (`time.process_time`) of one `schedule()` + `update_from_output()` in steady "
             "decode, no model; every running request decodes one token per step.", "",
             f"Command: `.venv/bin/python benchmarks/scheduler_overhead.py --steps {args.steps}`  ",
             f"Machine: {machine}, 2 shared cores (noisy, +-15%).", "",
             "| running | waiting | CPU ms / step | us / running request |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['num_running']} | {r['num_waiting']} | {r['cpu_ms_per_step']} | {r['us_per_running_request']} |")
    lines += ["", "Target: <= 1 ms per step at 256 running + 10k waiting.", "",
              f"Prefix-cache block keys ({hashing['block_size']}-token blocks, {hashing['blocks']:,} "
              f"chained): keyed BLAKE2b {hashing['blake2b_us_per_block']} us "
              f"per block vs {hashing['tuple_hash_us_per_block']} us for the 64-bit tuple hash it "
              "replaced (forgeable: see docs/architecture.md, prefix caching). A key is computed once "
              "per full block of a request (at admission lookup or when the block fills), so in steady "
              "decode it costs one key per request every block_size steps.", "",
              "Where the time goes: the waiting queue costs nothing per step once `max_num_seqs` is "
              "reached (the admission loop stops at its head), so the cost is linear in the number of "
              "running requests, about 2-3 us each: `update_from_output` (append the token, stop "
              "checks, publish a block every `block_size` tokens) is about half, `allocate_slots` "
              "(a new block every 16 tokens, otherwise arithmetic) about a quarter, and building "
              "the `SchedulerOutput` records the rest. Per-request cost grows at 1,024 running "
              "(cache misses on the larger working set).", ""]
    for r in results:
        lines += [f"## Profile: {r['num_running']} running, {r['num_waiting']} waiting (top by own time)",
                  "", "```", r["profile_top"], "```", ""]
    (OUT / "scheduler.md").write_text("\n".join(lines))
    for r in results:
        print(f"{r['num_running']} running + {r['num_waiting']} waiting: {r['cpu_ms_per_step']} ms/step")


if __name__ == "__main__":
    main()

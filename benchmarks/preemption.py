"""Preemption modes side by side on the default model: recompute vs swap vs auto, same run.

Workloads (a burst: every request arrives at once; random token ids, EOS ignored, so every
request produces exactly its output length), each on a KV pool small enough to preempt often:
  - long:   contexts of 1-4k tokens, a pool of 8k tokens
  - long-nocache: the same without prefix caching (a recomputed victim redoes its whole context;
            with the cache, the blocks it freed mostly survive until it returns)
  - short:  contexts of 32-160 tokens, a pool of 1k tokens
  - shared: a 1.5k-token shared prefix with short tails, a pool of 4k tokens (a victim's prefix
            stays cached, held by the others: recomputing it is nearly free, a swap copies it)
Per mode: output throughput, TTFT and TPOT p50/p99, tokens recomputed (computed a second time
after a preemption) and bytes copied between the device and the host tier. Modes run in
alternating order in one process (one model load), after a warm-up.

Writes docs/benchmarks/preemption.md and .json. Take the exclusive CPU lock:

    flock -x /work/notes/cpu.lock .venv/bin/python benchmarks/preemption.py [--workloads long,short,shared]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenweir import SamplingParams
from tokenweir.config import EngineArgs
from tokenweir.engine.core import EngineCore
from tokenweir.machine import cpu_name
from tokenweir.model.loader import load_model

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
MODES = ("recompute", "swap", "auto")
BLOCK_SIZE = 16


@dataclass(frozen=True)
class Workload:
    num_requests: int
    prompt_lens: tuple[int, int]  # uniform range
    output_len: int
    kv_tokens: int  # the device pool
    shared_prefix: int = 0
    prefix_caching: bool = True

    def requests(self, seed: int) -> list[tuple[list[int], int]]:
        rng = random.Random(seed)
        prefix = [rng.randrange(100, 49000) for _ in range(self.shared_prefix)]
        return [(prefix + [rng.randrange(100, 49000) for _ in range(rng.randint(*self.prompt_lens))],
                 self.output_len) for _ in range(self.num_requests)]


WORKLOADS = {
    "long": Workload(num_requests=10, prompt_lens=(1024, 4096), output_len=96, kv_tokens=8192),
    "long-nocache": Workload(num_requests=10, prompt_lens=(1024, 4096), output_len=96, kv_tokens=8192,
                             prefix_caching=False),
    "short": Workload(num_requests=48, prompt_lens=(32, 160), output_len=96, kv_tokens=1024),
    "shared": Workload(num_requests=12, prompt_lens=(16, 64), output_len=64, kv_tokens=4096, shared_prefix=1536),
}


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def run(loaded, workload: Workload, mode: str, args) -> dict:
    engine = EngineCore(EngineArgs(dtype=args.dtype, num_gpu_blocks_override=workload.kv_tokens // BLOCK_SIZE,
                                   block_size=BLOCK_SIZE, preemption_mode=mode,
                                   enable_prefix_caching=workload.prefix_caching,
                                   swap_space=0 if mode == "recompute" else args.swap_space), loaded=loaded)
    warm = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request("warm", list(range(100, 164)), warm)
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()
    base = engine.get_stats()

    requests = workload.requests(args.seed)
    start = time.perf_counter()
    for i, (prompt, out_len) in enumerate(requests):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True))
    recomputed, finished, steps = 0, [], 0
    while engine.has_unfinished_requests():
        scheduled = engine.schedule()
        for rid, n in scheduled.num_scheduled_tokens.items():
            r = engine.scheduler.requests[rid]
            recomputed += max(0, min(r.num_computed_tokens + n, r.max_computed_tokens) - r.num_computed_tokens)
        result = engine.execute(scheduled)
        assert not result.failed, result.failed
        finished += [o for o in result.outputs if o.finished]
        steps += 1
    elapsed = time.perf_counter() - start
    assert len(finished) == len(requests)
    stats = engine.get_stats()
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in finished]
    tpot = [(o.metrics.finished_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
            for o in finished]
    num_out = sum(len(o.outputs[0].token_ids) for o in finished)
    blocks_copied = (stats.num_blocks_swapped_out - base.num_blocks_swapped_out
                     + stats.num_blocks_swapped_in - base.num_blocks_swapped_in)
    by_mode = {m: stats.num_preemptions_by_mode[m] - base.num_preemptions_by_mode[m] for m in base.num_preemptions_by_mode}
    costs = engine.scheduler.preemption.costs
    return {
        "mode": mode, "seconds": elapsed, "steps": steps, "output_tokens": num_out,
        "output_throughput": num_out / elapsed,
        "ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99),
        "tpot_p50": percentile(tpot, 0.5), "tpot_p99": percentile(tpot, 0.99),
        "preemptions": by_mode, "tokens_recomputed": recomputed,
        "bytes_copied": blocks_copied * engine.cache_config.kv_block_bytes,
        "measured_swap_bandwidth": costs.swap_bytes_per_second if costs is not None else None,
    }


def warm_up(loaded, args) -> None:
    """The process's first long prefills run slower (allocator and oneDNN warm-up; the first
    mode of a round measured up to 2.5x slower without this): run two 4k-token requests first."""
    rng = random.Random(-1)
    engine = EngineCore(EngineArgs(dtype=args.dtype, num_gpu_blocks_override=8192 // BLOCK_SIZE), loaded=loaded)
    for i in range(2):
        engine.add_request(f"warm{i}", [rng.randrange(100, 49000) for _ in range(4000)],
                           SamplingParams(max_tokens=8, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--rounds", type=int, default=1, help="runs of every mode, in rotated order")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--swap-space", type=float, default=2.0, help="GiB of host memory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(OUT / "preemption"))
    args = parser.parse_args()
    loaded = load_model(None, args.dtype, "cpu")
    warm_up(loaded, args)
    modes = args.modes.split(",")
    results: dict[str, list[dict]] = {}
    for name in args.workloads.split(","):
        results[name] = []
        for round_ in range(args.rounds):
            order = modes[round_ % len(modes):] + modes[:round_ % len(modes)]
            for mode in order:
                r = run(loaded, WORKLOADS[name], mode, args)
                r["round"] = round_
                results[name].append(r)
                print(f"{name:7s} {mode:9s} {r['output_throughput']:7.1f} tok/s  {r['seconds']:6.1f} s  "
                      f"TTFT p50 {r['ttft_p50']:.2f} s  TPOT p50 {1e3 * r['tpot_p50']:.0f} ms  "
                      f"preemptions {r['preemptions']}  recomputed {r['tokens_recomputed']}  "
                      f"copied {r['bytes_copied'] / 2**20:.0f} MiB", flush=True)
    machine = {"cpu": cpu_name(), "threads": torch.get_num_threads(),
               "torch": torch.__version__, "dtype": str(loaded.dtype).removeprefix("torch.")}
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(
        {"machine": machine, "workloads": {k: vars(w) for k, w in WORKLOADS.items()}, "results": results},
        indent=2, default=list))
    print(f"wrote {out.with_suffix('.json')}")
    print(markdown_table(results))


def markdown_table(results: dict[str, list[dict]]) -> str:
    lines = ["| workload | mode | round | output tok/s | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | "
             "preemptions (recompute / swap) | tokens recomputed | MiB copied |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, runs in results.items():
        for r in runs:
            p = r["preemptions"]
            lines.append(f"| {name} | {r['mode']} | {r['round']} | {r['output_throughput']:.1f} | "
                         f"{r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} | {1e3 * r['tpot_p50']:.0f} / "
                         f"{1e3 * r['tpot_p99']:.0f} | {p['recompute']} / {p['swap']} | {r['tokens_recomputed']} | "
                         f"{r['bytes_copied'] / 2**20:.0f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""Admission orders (core/composition.py) on workloads where they could matter.

1. cache-aware vs the policy's order (fcfs) on a shared-prefix workload with eviction pressure:
   several system prompts, more than the prefix cache holds. Prefix hit rate, throughput, TTFT.
   In the simulator (the real Scheduler and KVCacheManager in virtual time, the shipped CPU
   profile), at several rates and aging bounds; with `--real`, also on `tokenweir serve` driven
   by `tokenweir bench serve` with the same workload flags (hit rate from /metrics).
2. length-aware vs fcfs on prompts of mixed lengths (simulator): does grouping lengths make
   prefill cheaper here?

Writes docs/benchmarks/batching_composition.json (+ .md is written by hand from it) and
docs/benchmarks/batching_plots/composition_*.png.

    flock -x /work/notes/cpu.lock .venv/bin/python benchmarks/batching_composition.py [--real]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from tokenweir.bench import serve as bench
from tokenweir.bench.serve_metrics import compute_metrics
from tokenweir.config import EngineArgs
from tokenweir.core.cost_model import load_cost_model
from tokenweir.sim.run import profile_label, sim_requests
from tokenweir.sim.simulator import Simulator

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks"
PLOTS = OUT / "batching_plots"

# 8 system prompts of 512 tokens (32 blocks each, 256 in all) in front of a 96-block pool: the
# cache holds two or three of them next to the running requests, so each order decides which
# prefixes stay.
PREFIX_WORKLOAD = ["--dataset-name", "prefix", "--num-prefixes", "8", "--prefix-len", "512",
                   "--suffix-len", "32", "--random-output-len", "16"]
PREFIX_ENGINE = dict(num_gpu_blocks_override=96, max_num_seqs=16)
# Prompts from 32 to 2,016 tokens (mean 1,024), short outputs: prefill-heavy.
LENGTH_WORKLOAD = ["--dataset-name", "random", "--random-input-len", "1024", "--random-range-ratio", "0.97",
                   "--random-output-len", "16"]


def workload_ns(flags: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_workload_args(parser)
    return parser.parse_args(flags)


def summarize(metrics, duration_s: float, hits: int, queries: int, ttfts: list) -> dict[str, Any]:
    ttft = metrics.stats["ttft"]
    return {"duration_s": round(duration_s, 3), "completed": metrics.completed,
            "request_throughput": round(metrics.request_throughput, 4),
            "total_token_throughput": round(metrics.total_token_throughput, 1),
            "prefix_hit_rate": round(hits / queries, 4) if queries else 0.0,
            "mean_ttft_ms": round(ttft.mean, 1), "median_ttft_ms": round(ttft.median, 1),
            "p99_ttft_ms": round(ttft.percentiles[99], 1),
            "max_ttft_ms": round(max(t for t in ttfts if t is not None) * 1e3, 1)}


def simulate(flags: list[str], engine: dict[str, Any], cost_model) -> dict[str, Any]:
    ns = workload_ns(flags)
    workload = bench.build_workload(ns, None)
    simulator = Simulator.from_engine_args(EngineArgs(**engine), cost_model, timeseries_points=1)
    result = simulator.run(sim_requests(workload))
    stats = simulator.scheduler.get_stats().prefix_cache
    metrics = compute_metrics(result.records, result.duration_s, [50, 99], {})
    return summarize(metrics, result.duration_s, stats.hits, stats.queries, [r.ttft for r in result.records])


# (order, aging bound in seconds); the bound is unused by `policy`.
VARIANTS = (("policy", 5.0), ("cache-aware", 2.0), ("cache-aware", 5.0), ("cache-aware", 10.0),
            ("cache-aware", 30.0), ("cache-aware", 60.0))


def order_args(order: str, max_wait: float) -> dict[str, Any]:
    """Engine args of an admission order: the aging bound only where there is one (`policy` refuses it)."""
    return {"admission_order": order, **({} if order == "policy" else {"admission_max_wait": max_wait})}


def prefix_sweep(cost_model, num_prompts: int) -> list[dict[str, Any]]:
    rows = []
    for rate in ("2", "4", "8", "inf"):
        flags = PREFIX_WORKLOAD + ["--num-prompts", str(num_prompts), "--request-rate", rate]
        for order, max_wait in VARIANTS:
            engine = dict(PREFIX_ENGINE, **order_args(order, max_wait))
            row = {"request_rate": rate, "admission_order": order,
                   "admission_max_wait": max_wait if order != "policy" else None,
                   **simulate(flags, engine, cost_model)}
            rows.append(row)
            print(row, flush=True)
    return rows


def length_sweep(cost_model, num_prompts: int) -> list[dict[str, Any]]:
    rows = []
    for rate in ("1", "2", "inf"):
        flags = LENGTH_WORKLOAD + ["--num-prompts", str(num_prompts), "--request-rate", rate]
        for order in ("policy", "length-aware"):
            # A long bound: with every request aged, any order is the policy's.
            row = {"request_rate": rate, "admission_order": order,
                   **simulate(flags, order_args(order, 600.0), cost_model)}
            rows.append(row)
            print(row, flush=True)
    return rows


def sampler_costs() -> list[dict[str, Any]]:
    """Milliseconds of one Sampler call on bf16 logits of SmolLM2's vocabulary: all rows greedy (the
    argmax-only path), one sampled row among greedy ones, all sampled. What sampling-grouped
    could save is the difference between the first two, on steps it makes all-greedy."""
    import torch

    from tokenweir.model.sampler import Sampler, SamplingMetadata

    torch.manual_seed(0)
    sampler, rows = Sampler(), []
    for batch in (8, 32, 64):
        logits = torch.randn(batch, 49152, dtype=torch.bfloat16)
        row: dict[str, Any] = {"batch": batch}
        for name, temps in (("all_greedy", [0.0] * batch), ("one_sampled", [0.0] * (batch - 1) + [0.8]),
                            ("all_sampled", [0.8] * batch)):
            meta = SamplingMetadata.build(temps)
            for _ in range(5):
                sampler(logits, meta)
            start = time.perf_counter()  # wall time: torch's threads would count twice in CPU time
            for _ in range(50):
                sampler(logits, meta)
            row[f"{name}_ms"] = round((time.perf_counter() - start) / 50 * 1e3, 3)
        rows.append(row)
        print(row, flush=True)
    return rows


# ---------------------------------------------------------------- the real engine

def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as response:
        return response.read().decode()


def prefix_counters(base_url: str) -> tuple[float, float]:
    text = _get(f"{base_url}/metrics")

    def total(name: str) -> float:
        return sum(float(m.group(1)) for m in re.finditer(rf"^tokenweir:{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))
    return total("prefix_cache_hits_total"), total("prefix_cache_queries_total")


def real_run(order: str, max_wait: float, num_prompts: int, rate: str, port: int) -> dict[str, Any]:
    engine_flags = [f"--{k.replace('_', '-')}={v}" for k, v in PREFIX_ENGINE.items()]
    server = subprocess.Popen(
        [sys.executable, "-m", "tokenweir.cli", "serve", "--port", str(port), "--disable-log-stats",
         *[f"--{k.replace('_', '-')}={v}" for k, v in order_args(order, max_wait).items()], *engine_flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 300
        while True:
            try:
                _get(f"{base_url}/health")
                break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"server did not start: {server.stderr.read()[-2000:]}")
                time.sleep(1)
        hits0, queries0 = prefix_counters(base_url)
        result_file = Path(f"/tmp/composition-{order}-{rate}.json")
        subprocess.run([sys.executable, "-m", "tokenweir.cli", "bench", "serve", "--base-url", base_url,
                        "--ignore-eos", *PREFIX_WORKLOAD, "--num-prompts", str(num_prompts),
                        "--request-rate", rate, "--metric-percentiles", "50,99",
                        "--result-dir", str(result_file.parent), "--result-filename", result_file.name],
                       check=True, stdout=subprocess.DEVNULL)
        hits, queries = prefix_counters(base_url)
    finally:
        server.terminate()
        server.wait(timeout=60)
    data = json.loads(result_file.read_text())
    hit_rate = (hits - hits0) / (queries - queries0) if queries > queries0 else 0.0
    return {"request_rate": rate, "admission_order": order,
            "admission_max_wait": max_wait if order != "policy" else None,
            "duration_s": round(data["duration"], 3), "completed": data["completed"],
            "request_throughput": round(data["request_throughput"], 4),
            "total_token_throughput": round(data["total_token_throughput"], 1),
            "prefix_hit_rate": round(hit_rate, 4), "mean_ttft_ms": round(data["mean_ttft_ms"], 1),
            "median_ttft_ms": round(data["median_ttft_ms"], 1), "p99_ttft_ms": round(data["p99_ttft_ms"], 1),
            "max_ttft_ms": round(max(t for t in data["ttfts"] if t is not None) * 1e3, 1)}


# ---------------------------------------------------------------- plots

def plot(prefix_rows: list[dict[str, Any]], real_rows: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    PLOTS.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    variants = [(o, None if o == "policy" else b, "fcfs" if o == "policy" else f"cache-aware, bound {b:g} s")
                for o, b in VARIANTS]
    rates = sorted({r["request_rate"] for r in prefix_rows}, key=float)
    width = 0.8 / len(variants)
    for ax, key, title in zip(axes, ("prefix_hit_rate", "request_throughput", "p99_ttft_ms"),
                              ("prefix hit rate", "requests / s", "p99 TTFT (s)")):
        scale = 1e-3 if key == "p99_ttft_ms" else 1.0
        for i, (order, bound, label) in enumerate(variants):
            values = [scale * next(r[key] for r in prefix_rows if r["request_rate"] == rate
                           and r["admission_order"] == order and r["admission_max_wait"] == bound) for rate in rates]
            ax.bar([x + i * width for x in range(len(rates))], values, width, label=label)
        ax.set_xticks([x + width * (len(variants) - 1) / 2 for x in range(len(rates))])
        ax.set_xticklabels([f"rate {r}" for r in rates])
        ax.set_title(title)
    axes[0].legend(fontsize=7)
    fig.suptitle("SIMULATED (shipped CPU profile smollm2-135m-cpu.json): 8 system prompts x 512 tokens, "
                 "96-block KV pool", fontsize=9)
    fig.tight_layout()
    fig.savefig(PLOTS / "composition_prefix_sim.png", dpi=110)
    plt.close(fig)
    if real_rows:
        fig, axes = plt.subplots(1, 3, figsize=(10, 3.2))
        labels = [f"{r['admission_order']}" for r in real_rows]
        for ax, key, title in zip(axes, ("prefix_hit_rate", "request_throughput", "p99_ttft_ms"),
                                  ("prefix hit rate", "requests / s", "p99 TTFT (ms)")):
            ax.bar(labels, [r[key] for r in real_rows], color=["tab:blue", "tab:orange"][:len(real_rows)])
            ax.set_title(title)
        fig.suptitle("REAL engine (tokenweir serve, SmolLM2-135M, CPU, shared machine): same workload", fontsize=9)
        fig.tight_layout()
        fig.savefig(PLOTS / "composition_prefix_real.png", dpi=110)
        plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-prompts", type=int, default=400)
    parser.add_argument("--real", action="store_true", help="also run the real engine (minutes)")
    parser.add_argument("--real-num-prompts", type=int, default=64)
    parser.add_argument("--real-rate", default="4")
    parser.add_argument("--port", type=int, default=8531)
    args = parser.parse_args()
    cost_model = load_cost_model(None)
    out_path = OUT / "batching_composition.json"
    previous = json.loads(out_path.read_text()) if out_path.exists() else {}
    result: dict[str, Any] = {
        "simulated_profile": profile_label(cost_model, None),
        "prefix_workload": PREFIX_WORKLOAD, "prefix_engine": PREFIX_ENGINE, "length_workload": LENGTH_WORKLOAD,
        "num_prompts": args.num_prompts,
        "prefix_sim": prefix_sweep(cost_model, args.num_prompts),
        "length_sim": length_sweep(cost_model, args.num_prompts // 2),
        "sampler": sampler_costs(),
    }
    if args.real:
        result["real"] = [real_run(order, 30.0, args.real_num_prompts, args.real_rate, args.port)
                          for order in ("policy", "cache-aware")]
        result["real_num_prompts"] = args.real_num_prompts
        for row in result["real"]:
            print(row, flush=True)
    elif "real" in previous:
        result["real"], result["real_num_prompts"] = previous["real"], previous.get("real_num_prompts")
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    plot(result["prefix_sim"], result.get("real", []))


if __name__ == "__main__":
    main()

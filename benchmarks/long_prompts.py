"""Long prompts must not starve short ones: TTFT of short requests arriving behind long prompts.

The shape of issue 14: 6 prompts of ~3,800 tokens arriving 0.2 s apart, with 24 short questions
interleaved (4 after each long one, 0.04 s apart). Each engine configuration gets a fresh
`tokenweir serve` (default model), one warm-up, then the workload, sent by `tokenweir bench
serve`'s own code (the trace dataset, from a CSV of this shape). Reports short-request TTFT
(p50, p99), long-request TTFT, total token throughput and the makespan, side by side. Writes
docs/benchmarks/batching_prefill.json and prints a markdown table. With --simulate, the same
workload and configurations go through `tokenweir simulate` (shipped CPU profile) instead:
SIMULATED numbers, written to batching_prefill_sim.json.

    .venv/bin/python benchmarks/long_prompts.py [--configs NAME ...] [--repeats 1] [--simulate]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from serving import BIN, OUT, ROOT, parse_bench_args, stop_server, wait_ready, warm_up
from tokenweir.bench import serve as bench_serve
from tokenweir.model.gguf_conversion import ensure_hf_folder
from tokenweir.model.loader import default_model_path

NUM_LONG, LONG_LEN, LONG_GAP_S = 6, 3800, 0.2
SHORTS_PER_LONG, SHORT_LEN, SHORT_GAP_S = 4, 24, 0.04
OUTPUT_LEN = 32
SHORT_MAX = 1000  # prompt length below which a request counts as short

CHUNKED = ["--max-num-batched-tokens", "512"]
CONFIGS: dict[str, list[str]] = {
    "no chunking": ["--no-enable-chunked-prefill"],
    "chunked 512": CHUNKED,
    "chunked 512, threshold 128": CHUNKED + ["--long-prefill-token-threshold", "128"],
    "chunked 512, partial 4/1": CHUNKED + ["--max-num-partial-prefills", "4", "--max-long-partial-prefills", "1"],
    "chunked 512, partial 4/1, threshold 128": CHUNKED + [
        "--max-num-partial-prefills", "4", "--max-long-partial-prefills", "1", "--long-prefill-token-threshold", "128"],
    "chunked 512, partial 4/2": CHUNKED + ["--max-num-partial-prefills", "4", "--max-long-partial-prefills", "2"],
    "budget 2048, partial 4/1": ["--max-num-partial-prefills", "4", "--max-long-partial-prefills", "1"],
}


def write_trace(path: Path) -> int:
    """The workload as a trace CSV (arrived_at, num_prefill_tokens, num_decode_tokens)."""
    rows = []
    for i in range(NUM_LONG):
        rows.append((i * LONG_GAP_S, LONG_LEN, OUTPUT_LEN))
        rows += [(i * LONG_GAP_S + (k + 1) * SHORT_GAP_S, SHORT_LEN, OUTPUT_LEN) for k in range(SHORTS_PER_LONG)]
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["arrived_at", "num_prefill_tokens", "num_decode_tokens"])
        writer.writerows(rows)
    return len(rows)


def summarize(result: dict) -> dict:
    lens, ttfts = np.array(result["input_lens"]), np.array(result["ttfts"], dtype=float)
    short, long = ttfts[lens < SHORT_MAX], ttfts[lens >= SHORT_MAX]
    return {"completed": result["completed"], "failed": result["failed"],
            "short_ttft_p50_s": float(np.percentile(short, 50)), "short_ttft_p99_s": float(np.percentile(short, 99)),
            "long_ttft_p50_s": float(np.percentile(long, 50)), "long_ttft_max_s": float(long.max()),
            "total_token_throughput": result["total_token_throughput"], "duration_s": result["duration"],
            "p99_itl_ms": result["p99_itl_ms"], "median_tpot_ms": result["median_tpot_ms"]}


def run_config(name: str, flags: list[str], trace: Path, num_prompts: int, hf_folder: str, port: int,
               seed: int) -> dict:
    command = [str(BIN / "tokenweir"), "serve", "--port", str(port), "--disable-uvicorn-access-log", *flags]
    print(f"[{name}] {' '.join(command)}", file=sys.stderr)
    base_url = f"http://127.0.0.1:{port}"
    log_path = Path(tempfile.gettempdir()) / f"tokenweir-long-prompts-{port}.log"
    with open(log_path, "w") as log:
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        try:
            wait_ready(base_url, proc, 600)
            warm_up(base_url, hf_folder, ignore_eos=True)
            result = bench_serve.main(parse_bench_args([
                "--base-url", base_url, "--dataset-name", "trace", "--trace-path", str(trace),
                "--num-prompts", str(num_prompts), "--tokenizer", hf_folder, "--seed", str(seed),
                "--ignore-eos", "--metric-percentiles", "50,99"]))
        finally:
            stop_server(proc)
    return {"config": name, "flags": flags, "seed": seed, **summarize(result)}


def simulate_config(name: str, flags: list[str], trace: Path, num_prompts: int, hf_folder: str, seed: int,
                    tmp: Path) -> dict:
    """The same workload through the simulator (virtual time, the shipped profile)."""
    out = tmp / f"sim-{seed}-{len(flags)}-{abs(hash(name))}.json"
    subprocess.run([str(BIN / "tokenweir"), "simulate", *flags, "--dataset-name", "trace", "--trace-path", str(trace),
                    "--num-prompts", str(num_prompts), "--tokenizer", hf_folder, "--seed", str(seed),
                    "--metric-percentiles", "50,99", "--disable-tqdm", "--result-filename", str(out)],
                   check=True, cwd=ROOT, stdout=subprocess.DEVNULL, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    result = json.loads(out.read_text())
    return {"config": name, "flags": flags, "seed": seed, "simulated": True, "profile": result.get("profile"),
            **summarize(result)}


def markdown(runs: list[dict], baseline: dict) -> str:
    lines = ["| configuration | short TTFT p50 s | short TTFT p99 s | x better (p99) | long TTFT p50 s | "
             "total tok/s | vs no chunking | makespan s | ITL p99 ms |", "|" + "---|" * 9]
    for r in runs:
        lines.append(
            f"| {r['config']} | {r['short_ttft_p50_s']:.2f} | {r['short_ttft_p99_s']:.2f} | "
            f"{baseline['short_ttft_p99_s'] / r['short_ttft_p99_s']:.1f}x | {r['long_ttft_p50_s']:.2f} | "
            f"{r['total_token_throughput']:.0f} | "
            f"{100 * (r['total_token_throughput'] / baseline['total_token_throughput'] - 1):+.1f}% | "
            f"{r['duration_s']:.1f} | {r['p99_itl_ms']:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--repeats", type=int, default=1, help="runs of each configuration (fresh prompts each)")
    parser.add_argument("--port", type=int, default=8130)
    parser.add_argument("--simulate", action="store_true", help="tokenweir simulate instead of a server")
    parser.add_argument("--output", type=Path, default=None,
                        help="default: docs/benchmarks/batching_prefill.json (_sim.json with --simulate)")
    ns = parser.parse_args()
    output = ns.output or OUT / ("batching_prefill_sim.json" if ns.simulate else "batching_prefill.json")
    hf_folder = ensure_hf_folder(default_model_path())
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "long_prompts.csv"
        num_prompts = write_trace(trace)
        if ns.simulate:
            runs = [simulate_config(name, CONFIGS[name], trace, num_prompts, hf_folder, seed, Path(tmp))
                    for seed in range(ns.repeats) for name in ns.configs]
        else:
            runs = [run_config(name, CONFIGS[name], trace, num_prompts, hf_folder, ns.port, seed)
                    for seed in range(ns.repeats) for name in ns.configs]
    baseline = next((r for r in runs if r["config"] == "no chunking"), runs[0])
    report = {"workload": {"num_long": NUM_LONG, "long_len": LONG_LEN, "long_gap_s": LONG_GAP_S,
                           "shorts_per_long": SHORTS_PER_LONG, "short_len": SHORT_LEN, "short_gap_s": SHORT_GAP_S,
                           "output_len": OUTPUT_LEN},
              "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, {os.cpu_count()} cores "
                         f"(shared), CPython {platform.python_version()}",
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": runs}
    output.write_text(json.dumps(report, indent=2))
    print(markdown(runs, baseline))


if __name__ == "__main__":
    main()

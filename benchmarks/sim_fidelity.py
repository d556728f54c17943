"""How close is the simulator to the real engine? One run on this machine, side by side:

1. `tokenweir profile --serving` on the default model (the profile the simulator then uses: the
   cost model fitted to `tokenweir serve`'s own step times under a synthetic load, not to the
   trace replayed below);
2. `tokenweir serve` with the default engine flags, loaded by `tokenweir bench serve` replaying
   the Azure conversation trace at several rate scales (light load to past saturation);
3. `tokenweir simulate` with the same engine and workload flags and that profile.

It reports, per rate, the relative error (simulated / real - 1) of median and p99 TTFT, median
and p99 TPOT, median E2EL and output throughput, and writes everything to
docs/benchmarks/sim_fidelity.json. The server writes its step trace too, so the profile's
error on the very steps the trace replay ran is reported as well (per rate and region): it
tells a cost-model error from one the simulated queue compounds. The trace itself is kept
in the run's work directory (printed). Run it alone on the machine: every number is a wall-clock
measurement of the real engine.

    python benchmarks/sim_fidelity.py --rate-scales 0.5,1,1.5,2,3 --num-prompts 80
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from tokenweir.core.cost_model import StepComposition, StepCostModel, load_cost_model
from tokenweir.engine.step_trace import read_step_trace
from tokenweir.profiling.serving import free_port, region_of, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "benchmarks"
TOKENWEIR = [sys.executable, "-m", "tokenweir.cli"]
METRICS = [("median_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99"), ("median_tpot_ms", "TPOT p50"),
           ("p99_tpot_ms", "TPOT p99"), ("median_e2el_ms", "E2EL p50"), ("output_throughput", "out tok/s")]


def run(cmd: list[str], **kw) -> None:
    print("+", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, check=True, **kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate-scales", default="0.5,1,1.5,2,3")
    ap.add_argument("--num-prompts", type=int, default=80)
    ap.add_argument("--max-input-len", type=int, default=512)
    ap.add_argument("--max-output-len", type=int, default=128)
    ap.add_argument("--profile", type=Path, default=None,
                    help="use this profile instead of taking a new one")
    ap.add_argument("--output", type=Path, default=OUT / "sim_fidelity.json")
    ns = ap.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    work = Path(tempfile.mkdtemp(prefix="sim-fidelity-"))
    profile = ns.profile or work / "profile.json"
    started = time.perf_counter()
    if ns.profile is None:
        run([*TOKENWEIR, "profile", "--serving", "--output", str(profile)], env=env)
    meta = json.loads(profile.read_text())["metadata"]
    tokenizer = meta.get("model_path")
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    trace = work / "server-steps.jsonl"
    server = subprocess.Popen([*TOKENWEIR, "serve", "--port", str(port), "--disable-log-stats",
                               "--step-trace", str(trace)], env=env)
    model = load_cost_model(profile)
    rows = []
    try:
        wait_healthy(base_url, server)
        # The server's first steps pay for lazy set-up (the profile skips them too): a few
        # requests of random tokens (no prefix of the trace's) go first, unmeasured.
        run([*TOKENWEIR, "bench", "serve", "--base-url", base_url, "--ignore-eos", "--dataset-name", "random",
             "--num-prompts", "4", "--random-input-len", "128", "--random-output-len", "16",
             "--max-concurrency", "2", *(["--tokenizer", tokenizer] if tokenizer else [])],
            env=env, stdout=subprocess.DEVNULL)
        steps_before = len(read_step_trace(trace)[1])
        for i, scale in enumerate(float(s) for s in ns.rate_scales.split(",")):
            # A seed per rate: the same prompts again would hit the server's prefix cache, which
            # the simulator (starting cold) does not have.
            workload = ["--seed", str(i), "--dataset-name", "trace", "--num-prompts", str(ns.num_prompts),
                        "--rate-scale", f"{scale:g}", "--max-input-len", str(ns.max_input_len),
                        "--max-output-len", str(ns.max_output_len), "--result-dir", str(work)]
            if tokenizer:
                workload += ["--tokenizer", tokenizer]
            real_file, sim_file = f"real-{scale:g}.json", f"sim-{scale:g}.json"
            run([*TOKENWEIR, "bench", "serve", "--base-url", base_url, "--ignore-eos",
                 "--result-filename", real_file, *workload], env=env)
            run([*TOKENWEIR, "simulate", "--profile", str(profile), "--disable-tqdm",
                 "--result-filename", sim_file, *workload], env=env, stdout=subprocess.DEVNULL)
            real = json.loads((work / real_file).read_text())
            sim = json.loads((work / sim_file).read_text())
            if real["failed"] or real["total_output_tokens"] != sim["total_output_tokens"]:
                raise RuntimeError(f"x{scale:g}: the real run failed requests or produced other lengths "
                                   f"({real['failed']} failed, {real['total_output_tokens']} vs "
                                   f"{sim['total_output_tokens']} tokens)")
            row = {"rate_scale": scale, "request_rate": ns.num_prompts / real["duration"],
                   "real": {k: real[k] for k, _ in METRICS}, "simulated": {k: sim[k] for k, _ in METRICS},
                   "error": {k: sim[k] / real[k] - 1 for k, _ in METRICS if real[k]},
                   "real_duration_s": real["duration"], "simulated_duration_s": sim["duration"],
                   "simulated_wall_seconds": sim.get("wall_seconds")}
            # The trace is line-buffered: every step of this rate's replay is on disk now.
            _, steps = read_step_trace(trace)
            row["step_error"] = step_errors(model, steps[steps_before:])
            row["trace_steps"] = [steps_before, len(steps)]
            steps_before = len(steps)
            rows.append(row)
            print(f"x{scale:g}: " + ", ".join(f"{label} {100 * row['error'].get(k, 0):+.1f}%"
                                               for k, label in METRICS), file=sys.stderr)
    finally:
        server.terminate()
        server.wait(timeout=60)
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared)",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join(["python", "benchmarks/sim_fidelity.py", *sys.argv[1:]]),
        "profile": {k: v for k, v in json.loads(profile.read_text()).items() if k != "samples"},
        "workload": {"dataset": "trace", "num_prompts": ns.num_prompts,
                     "max_input_len": ns.max_input_len, "max_output_len": ns.max_output_len},
        "seconds": round(time.perf_counter() - started, 1),
        "rates": rows,
    }
    ns.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"the server's step trace: {trace}", file=sys.stderr)
    print_table(result)


def step_errors(model: StepCostModel, steps: list[tuple[StepComposition, float]]) -> dict:
    """The profile's error on the real run's steps, per region: the median of predicted / real
    - 1 (its bias, which a simulated queue compounds) and the mean absolute error."""
    by_region: dict[str, list[float]] = {}
    for comp, seconds in steps:
        err = model.predict(comp) / seconds - 1
        by_region.setdefault(region_of(comp), []).append(err)
        by_region.setdefault("all", []).append(err)
    return {region: {"steps": len(e), "median_error": statistics.median(e),
                     "mape": statistics.fmean(abs(x) for x in e)} for region, e in by_region.items()}


def print_table(result: dict) -> None:
    print("| rate scale | " + " | ".join(f"{label} real / sim (err)" for _, label in METRICS) + " |")
    print("|---" * (len(METRICS) + 1) + "|")
    for row in result["rates"]:
        cells = [f"{row['real'][k]:.0f} / {row['simulated'][k]:.0f} ({100 * row['error'].get(k, 0):+.1f}%)"
                 for k, _ in METRICS]
        print(f"| x{row['rate_scale']:g} | " + " | ".join(cells) + " |")
    print("\nThe profile on the real run's steps (median predicted / real - 1, MAPE):")
    for row in result["rates"]:
        cells = [f"{region} {e['steps']} steps {100 * e['median_error']:+.1f}% ({100 * e['mape']:.1f}%)"
                 for region, e in row["step_error"].items()]
        print(f"x{row['rate_scale']:g}: " + ", ".join(cells))


if __name__ == "__main__":
    main()

"""SLO-driven batch sizing against static limits, in the simulator (issue 14, item 5a).

The Azure conversation trace (../shared/data) replayed through the simulated engine with the
shipped CPU profile (or --profile): a sweep of static max_num_batched_tokens x max_num_seqs
against `--batch-controller slo` at several rate scales, and one run whose rate steps up
half-way (`rate_step_arrivals`). For each rate: the best static configuration that meets the
TPOT target (p99) by request throughput, and slo. For the step: how long slo takes to settle
(its windowed p99 ITL back under the target for good) and a plot of its limits and windowed
p99 ITL/TPOT over time. Every number is SIMULATED.

    python benchmarks/batching_slo.py --target-tpot-ms 250
    python benchmarks/batching_slo.py --real --rate-scales 1.5 --num-prompts 100 --repeats 2 \\
        --statics 256/32,128/64,2048/128   # the real engine

`--real` confirms on `tokenweir serve` (default model) loaded by `tokenweir bench serve` with the
same trace rows: slo against the static pairs given by `--statics` (default: the best static
configuration of the simulated sweep at that rate, read from the JSON of a simulated run), in
interleaved rounds, with the simulator's numbers for the same workload beside them, and records
the slo gauges and log lines it printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from tokenweir.bench.datasets import PromptBuilder, TraceRow, read_trace
from tokenweir.bench.serve_metrics import compute_metrics, metrics_to_dict
from tokenweir.config import EngineArgs
from tokenweir.core.batch_slo import weighted_quantile
from tokenweir.core.cost_model import StepCostModel, load_cost_model, step_composition
from tokenweir.sim.run import profile_label
from tokenweir.sim.simulator import SimRequest, Simulator

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "data" / "azure_llm_2023_conv.csv"
OUT = ROOT / "docs" / "benchmarks"
BUDGETS = (128, 256, 512, 1024, 2048)
CAPS = (8, 16, 32, 64, 128, 256)


def rate_step_arrivals(arrivals: Sequence[float], at_index: int, scale_before: float,
                       scale_after: float) -> list[float]:
    """Trace arrival times replayed `scale_before` times as fast up to request `at_index`, and
    `scale_after` times from there on (the gaps keep the trace's shape)."""
    if not (scale_before > 0 and scale_after > 0) or not 0 <= at_index <= len(arrivals):
        raise ValueError(f"rate step needs scales > 0 and an index in [0, {len(arrivals)}], "
                         f"got {scale_before}, {scale_after}, {at_index}")
    out, now, prev = [], 0.0, arrivals[0] if arrivals else 0.0
    for i, t in enumerate(arrivals):
        now += (t - prev) / (scale_before if i < at_index else scale_after)
        prev = t
        out.append(now)
    return out


def requests(rows: Sequence[TraceRow], arrivals: Sequence[float]) -> list[SimRequest]:
    builder = PromptBuilder(np.random.default_rng(0))
    return [SimRequest(f"r{i}", builder.build(r.prompt_len)[1], r.output_len, t)
            for i, (r, t) in enumerate(zip(rows, arrivals))]


def simulate(args: EngineArgs, cost: StepCostModel, reqs: list[SimRequest]) -> tuple[dict[str, Any], dict]:
    # (start, budget, cap, decode rows, seconds): a decode row's ITL is its step's time.
    steps: list[tuple[float, int, int, int, float]] = []

    def on_step(out, now):
        limits, sched = sim.scheduler.step_limits, sim.scheduler
        rows = sum(1 for rid, n in out.num_scheduled_tokens.items()
                   if n == 1 and sched.requests[rid].num_output_tokens > 0)
        seconds = cost.predict(step_composition(out, sched.requests, sim.kv_bytes_per_block))
        steps.append((now, limits.max_num_batched_tokens, limits.max_num_seqs, rows, seconds))

    sim = Simulator.from_engine_args(args, cost, on_step=on_step)
    result = sim.run(reqs)
    m = metrics_to_dict(compute_metrics(result.records, result.duration_s, (50, 99)), ["ttft", "tpot", "itl"])
    finished = [(q.arrival_s + r.latency, r.tpot) for q, r in zip(reqs, result.records)
                if r.success and r.output_tokens > 1]
    keep = ("request_throughput", "output_throughput", "p99_tpot_ms", "median_tpot_ms", "p99_itl_ms",
            "median_ttft_ms", "p99_ttft_ms")
    return {k: round(m[k], 4) for k in keep} | {"num_preemptions": result.num_preemptions}, \
        {"steps": steps, "finished": finished, "end": result.duration_s}


def windowed(series: dict, window: float, points: int = 300) -> dict[str, list]:
    """Per time point: the limits then, the p99 ITL of the steps (weighted by decode rows) and
    the p99 TPOT of the requests that finished in the window before it."""
    steps, finished = series["steps"], sorted(series["finished"])
    starts = np.array([s[0] for s in steps])
    out: dict[str, list] = {"t": [], "budget": [], "cap": [], "p99_itl_ms": [], "p99_tpot_ms": []}
    fin_t = np.array([f[0] for f in finished])
    for t in np.linspace(window, series["end"], points):
        lo, hi = np.searchsorted(starts, t - window), np.searchsorted(starts, t)
        if hi == 0:
            continue
        itl = weighted_quantile(((steps[i][4], steps[i][3]) for i in range(lo, hi)), 0.99)
        a, b = np.searchsorted(fin_t, t - window), np.searchsorted(fin_t, t)
        tpots = [finished[i][1] for i in range(a, b)]
        out["t"].append(round(float(t), 2))
        out["budget"].append(steps[hi - 1][1])
        out["cap"].append(steps[hi - 1][2])
        out["p99_itl_ms"].append(None if itl is None else round(1000 * itl, 1))
        out["p99_tpot_ms"].append(round(1000 * float(np.percentile(tpots, 99)), 1) if tpots else None)
    return out


def settle_time(w: dict[str, list], change_at: float, bound_ms: float) -> Optional[float]:
    """Seconds after the change until the windowed p99 ITL stays under `bound_ms` to the end."""
    last_bad = change_at
    for t, v in zip(w["t"], w["p99_itl_ms"]):
        if t >= change_at and v is not None and v > bound_ms:
            last_bad = t
    return round(last_bad - change_at, 1)


def plot(step_runs: dict[str, dict], change_at: float, target_ms: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    w = step_runs["slo"]
    top.plot(w["t"], w["budget"], label="token budget (slo)")
    top.set_ylabel("max_num_batched_tokens")
    twin = top.twinx()
    twin.plot(w["t"], w["cap"], color="tab:orange", label="sequence cap (slo)")
    twin.set_ylabel("max_num_seqs")
    top.legend(loc="upper left")
    twin.legend(loc="upper right")
    for name, run in step_runs.items():
        bottom.plot(run["t"], run["p99_itl_ms"], label=f"{name}: windowed p99 ITL")
        bottom.plot(run["t"], run["p99_tpot_ms"], linestyle="--", label=f"{name}: windowed p99 TPOT")
    bottom.axhline(target_ms, color="red", linewidth=1, label="target")
    bottom.set_ylim(0, 3 * target_ms)
    for ax in (top, bottom):
        ax.axvline(change_at, color="grey", linestyle=":")
    bottom.set_xlabel("simulated seconds (rate steps up at the dotted line)")
    bottom.set_ylabel("ms")
    bottom.legend(fontsize=7)
    fig.suptitle("SIMULATED (shipped CPU profile): slo batch control after a load step")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


TOKENWEIR = [sys.executable, "-m", "tokenweir.cli"]
REAL_KEYS = ("request_throughput", "output_throughput", "p99_tpot_ms", "median_tpot_ms", "p99_itl_ms",
             "median_ttft_ms", "p99_ttft_ms", "duration", "failed")


def serve_and_bench(engine_flags: list[str], workload: list[str], work: Path, name: str) -> dict[str, Any]:
    from tokenweir.profiling.serving import free_port, wait_healthy

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log = (work / f"{name}.log").open("w")
    server = subprocess.Popen([*TOKENWEIR, "serve", "--port", str(port), *engine_flags], env=env,
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_healthy(base_url, server)
        subprocess.run([*TOKENWEIR, "bench", "serve", "--base-url", base_url, "--ignore-eos",
                        "--result-dir", str(work), "--result-filename", f"{name}.json", *workload],
                       env=env, check=True, stdout=subprocess.DEVNULL)
        metrics = urllib.request.urlopen(f"{base_url}/metrics").read().decode()
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
    real = json.loads((work / f"{name}.json").read_text())
    out = {k: round(real[k], 4) for k in REAL_KEYS} | {"engine_flags": engine_flags}
    out["gauges"] = [line for line in metrics.splitlines() if line.startswith("tokenweir:batch_max")]
    out["log_lines"] = [line.split("INFO", 1)[-1].strip() for line in (work / f"{name}.log").read_text().splitlines()
                        if "Batch limits" in line][-3:]
    return out


def parse_statics(text: str) -> list[tuple[int, int]]:
    """"1024/32,128/64" -> [(1024, 32), (128, 64)] (max_num_batched_tokens / max_num_seqs)."""
    pairs = []
    for item in filter(None, text.split(",")):
        budget, _, cap = item.partition("/")
        pairs.append((int(budget), int(cap)))
    return pairs


def confirm_real(ns: argparse.Namespace) -> None:
    sim = json.loads(ns.output.read_text())
    cost = load_cost_model(ns.profile)
    work = Path(tempfile.mkdtemp(prefix="batching-slo-"))
    # Runs of other rates (an earlier command) are kept: each entry says how it was made.
    real: dict[str, Any] = sim.get("real", {"rates": []})
    slo_flags = ["--batch-controller", "slo", "--target-tpot-ms", f"{ns.target_tpot_ms:g}"]
    for scale in map(float, ns.rate_scales.split(",")):
        if ns.statics:
            statics, source = parse_statics(ns.statics), "--statics"
        else:  # the best static of the simulated sweep at this rate, else at its highest rate
            simulated = [r for r in sim["rates"] if r["rate_scale"] == scale] or sim["rates"][-1:]
            best = simulated[0]["best_static"]
            statics = [(best["max_num_batched_tokens"], best["max_num_seqs"])]
            source = f"best static of the simulated sweep at x{simulated[0]['rate_scale']:g}"
        configs: dict[str, tuple[list[str], EngineArgs]] = {
            "slo": (slo_flags, EngineArgs(batch_controller="slo", target_tpot_ms=ns.target_tpot_ms))}
        for b, s in statics:
            configs[f"{b}/{s}"] = (["--max-num-batched-tokens", str(b), "--max-num-seqs", str(s)],
                                   EngineArgs(max_num_batched_tokens=b, max_num_seqs=s))
        workload = ["--dataset-name", "trace", "--trace-path", str(TRACE), "--num-prompts", str(ns.num_prompts),
                    "--rate-scale", f"{scale:g}", "--max-input-len", str(ns.max_input_len),
                    "--max-output-len", str(ns.max_output_len), "--percentile-metrics", "ttft,tpot,itl",
                    "--metric-percentiles", "50,99"]
        # The simulator's numbers for this very workload, beside the measured ones.
        rows = read_trace(TRACE, ns.num_prompts, scale, ns.max_input_len, ns.max_output_len)
        reqs = requests(rows, [r.arrival_s for r in rows])
        entry = {"rate_scale": scale, "num_prompts": ns.num_prompts,
                 "command": " ".join(["python", "benchmarks/batching_slo.py", *sys.argv[1:]]),
                 "statics_from": source, "simulated_profile": profile_label(cost, ns.profile),
                 "simulated": {name: simulate(args, cost, reqs)[0] for name, (_, args) in configs.items()},
                 "rounds": []}
        real["rates"] = [r for r in real["rates"]
                         if (r["rate_scale"], r["num_prompts"]) != (scale, ns.num_prompts)] + [entry]
        # Interleaved rounds (every configuration once per round): on a shared machine a
        # difference counts only if it holds in each round.
        for i in range(ns.repeats):
            entry["rounds"].append({
                name: serve_and_bench(flags, workload, work, f"{name.replace('/', '-')}-{scale:g}-{i}")
                for name, (flags, _) in configs.items()})
            sim["real"] = real  # written after every round: a cut-off command keeps what it measured
            ns.output.write_text(json.dumps(sim, indent=1) + "\n")
        print(json.dumps(entry, indent=1), file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", type=Path, default=None)
    ap.add_argument("--target-tpot-ms", type=float, default=250.0)
    ap.add_argument("--rate-scales", default="0.1,0.2,0.3,0.4")
    ap.add_argument("--step-scales", default="0.1,0.4", help="rate scale before,after the step")
    ap.add_argument("--num-prompts", type=int, default=300)
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--max-output-len", type=int, default=256)
    ap.add_argument("--output", type=Path, default=OUT / "batching_slo.json")
    ap.add_argument("--real", action="store_true", help="confirm on the real engine (see above)")
    ap.add_argument("--repeats", type=int, default=1, help="--real: rounds per rate (slo, then each static)")
    ap.add_argument("--statics", default="",
                    help="--real: static pairs to run against slo, e.g. 1024/32,2048/64 (default: the "
                         "simulated sweep's best static at that rate)")
    ns = ap.parse_args()
    if ns.real:
        confirm_real(ns)
        return
    cost = load_cost_model(ns.profile)
    rows = read_trace(TRACE, ns.num_prompts, 1.0, ns.max_input_len, ns.max_output_len)
    trace_times = [r.arrival_s for r in rows]
    slo_args = EngineArgs(batch_controller="slo", target_tpot_ms=ns.target_tpot_ms)
    window = slo_args.create_engine_configs(8192, 1)[1].batch_control_config.window
    statics = [(b, s) for b in BUDGETS for s in CAPS if s <= b]
    result: dict[str, Any] = {"simulated": True, "profile": profile_label(cost, ns.profile),
                              "target_tpot_ms": ns.target_tpot_ms, "num_prompts": ns.num_prompts,
                              "max_input_len": ns.max_input_len, "max_output_len": ns.max_output_len,
                              "rates": []}
    for scale in map(float, ns.rate_scales.split(",")):
        reqs = requests(rows, [t / scale for t in trace_times])
        entry: dict[str, Any] = {"rate_scale": scale, "offered_rate": round(len(reqs) / reqs[-1].arrival_s, 3),
                                 "static": []}
        for b, s in statics:
            m, _ = simulate(EngineArgs(max_num_batched_tokens=b, max_num_seqs=s), cost, reqs)
            entry["static"].append({"max_num_batched_tokens": b, "max_num_seqs": s, **m})
        entry["slo"], _ = simulate(slo_args, cost, reqs)
        meeting = [r for r in entry["static"] if r["p99_tpot_ms"] <= ns.target_tpot_ms]
        entry["best_static"] = max(meeting, key=lambda r: r["request_throughput"], default=None)
        result["rates"].append(entry)
        best = entry["best_static"]
        print(f"scale {scale}: slo {entry['slo']['request_throughput']:.3f} req/s at p99 TPOT "
              f"{entry['slo']['p99_tpot_ms']:.0f} ms; best static meeting the target: "
              f"{best and (best['max_num_batched_tokens'], best['max_num_seqs'], best['request_throughput'])}",
              file=sys.stderr)
    before, after = map(float, ns.step_scales.split(","))
    half = len(rows) // 2
    step_times = rate_step_arrivals(trace_times, half, before, after)
    reqs = requests(rows, step_times)
    change_at = step_times[half]
    step: dict[str, Any] = {"scale_before": before, "scale_after": after, "change_at_s": round(change_at, 2)}
    series = {}
    step["slo"], raw = simulate(slo_args, cost, reqs)
    series["slo"] = windowed(raw, window)
    step["slo_settle_s"] = settle_time(series["slo"], change_at, ns.target_tpot_ms)
    step["slo_settle_within_5pct_s"] = settle_time(series["slo"], change_at, 1.05 * ns.target_tpot_ms)
    best_at_after = result["rates"][-1]["best_static"] if result["rates"] else None
    if best_at_after is not None:
        b, s = best_at_after["max_num_batched_tokens"], best_at_after["max_num_seqs"]
        step["static"], raw = simulate(EngineArgs(max_num_batched_tokens=b, max_num_seqs=s), cost, reqs)
        step["static"] |= {"max_num_batched_tokens": b, "max_num_seqs": s}
        series[f"static {b}/{s}"] = windowed(raw, window)
    step["series"] = series
    result["step"] = step
    plot(series, change_at, ns.target_tpot_ms, OUT / "batching_plots" / "slo_step.png")
    if ns.output.exists():  # the real-engine runs of `--real` stay
        result["real"] = json.loads(ns.output.read_text()).get("real", {"rates": []})
    ns.output.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in step.items() if k != "series"}, indent=1))


if __name__ == "__main__":
    main()

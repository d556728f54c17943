"""SLO-driven batch sizing against static limits, in the simulator (issue 14, item 5a).

The Azure conversation trace (../shared/data) replayed through the simulated engine with the
shipped CPU profile (or --profile): a sweep of static max_num_batched_tokens x max_num_seqs
against `--batch-controller slo` at several rate scales, and one run whose rate steps up
half-way (`rate_step_arrivals`, `tokenweir bench serve --rate-step`). The sweep runs on the
first --num-prompts trace rows and again on the shorter workloads of the real-engine runs
(--short-sweep, 100 rows at x0.4, x1.5, x3). For each rate, by three criteria (CRITERIA): the
best static configuration by request throughput that meets p99 TPOT <= target over the whole
run, the best that meets it at every moment of the run as slo measures it (the windowed p99
TPOT: this benchmark's reading of the issue's target), and the best that meets p99 ITL <=
target too (what slo holding ITL holds itself to: a static pair can meet p99 TPOT while its
long prefill steps stall every decode row beside them), and slo against each, from the runs'
durations to the millisecond. For the step: how long slo takes to settle (its windowed p99 ITL
back under the target for good), against the best static pairs of the last rate by each
criterion, and a plot of its limits and windowed p99
ITL/TPOT over time. Every number is SIMULATED.

    python benchmarks/batching_slo.py --target-tpot-ms 250
    python benchmarks/batching_slo.py --real --rate-scales 1.5 --num-prompts 100 --repeats 2 \\
        --statics 256/32,128/64,2048/128   # the real engine
    python benchmarks/batching_slo.py --real --rate-scales "" --step-scales 0.4,1.5 --num-prompts 160 \\
        --repeats 2 --statics 256/32       # the load step on the real engine

`--real` confirms on `tokenweir serve` (default model) loaded by `tokenweir bench serve` with the
same trace rows: slo against the static pairs given by `--statics` (default: the best static
configuration of the simulated sweep at that rate by the windowed p99 TPOT, read from the JSON
of a simulated run), in interleaved rounds, with the simulator's numbers for the same workload
beside them, and records the slo gauges and log lines it printed and each request's TPOT as the
client saw it (placed at its trace arrival plus its latency: the send's lag behind its
scheduled time, milliseconds, is not counted). With `--step-scales` it also runs the load step
(`bench serve --rate-step`): the windowed p99 ITL from the inter-token gaps the client saw, the
limits from the gauges polled once a second, and the same re-settling time as simulated.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from tokenweir.bench.datasets import PromptBuilder, TraceRow, rate_step_arrivals, read_trace
from tokenweir.bench.serve_metrics import compute_metrics, metrics_to_dict
from tokenweir.config import EngineArgs
from tokenweir.core.batch_slo import MIN_TPOTS, weighted_quantile
from tokenweir.core.cost_model import StepCostModel, load_cost_model, step_composition
from tokenweir.sim.run import profile_label
from tokenweir.sim.simulator import SimRequest, Simulator

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "data" / "azure_llm_2023_conv.csv"
OUT = ROOT / "docs" / "benchmarks"
BUDGETS = (128, 256, 512, 1024, 2048)
CAPS = (8, 16, 32, 64, 128, 256)


def requests(rows: Sequence[TraceRow], arrivals: Sequence[float]) -> list[SimRequest]:
    builder = PromptBuilder(np.random.default_rng(0))
    return [SimRequest(f"r{i}", builder.build(r.prompt_len)[1], r.output_len, t)
            for i, (r, t) in enumerate(zip(rows, arrivals))]


def controller_window(target_tpot_ms: float) -> float:
    """Seconds of `slo`'s window (--batch-control-window's default): the window of the windowed
    p99 TPOT it holds, and of the criterion that asks it of every run."""
    return slo_engine_args(target_tpot_ms, "itl").create_engine_configs(8192, 1)[1].batch_control_config.window


def windowed_p99_tpot(finished: Sequence[tuple[float, float]], window: float,
                      least: int = MIN_TPOTS) -> Optional[float]:
    """The highest p99 TPOT (seconds; `bench serve`'s interpolated percentile) that `slo`'s own
    measure would show at any moment of the run, `finished` being (finish time, TPOT): over the
    requests finished in the last `window` seconds, and at least the last `least` of them
    whatever their age (core/batch_slo.py keeps as many, and takes no p99 before it has them).
    None without any finished request; a run of fewer than `least`, over all of them.

    The requests measured change only when one finishes and when one leaves the window,
    `window` seconds after it finished, so each of those moments is tried. Each moment's bounds
    come from the finish times themselves, never from a start computed back from an end:
    rounding could move such a start past the finish the window ends at."""
    ordered = sorted(finished)
    times = [t for t, _ in ordered]
    tpots = [tpot for _, tpot in ordered]
    if len(ordered) < least:
        return float(np.percentile(tpots, 99)) if tpots else None
    worst = -math.inf
    for t in times:
        # When a request finishes, (t - window, t]; when it leaves the window, (t, t + window]
        # (requests finishing together leave together).
        for lo, hi in ((bisect.bisect_right(times, t - window), bisect.bisect_right(times, t)),
                       (bisect.bisect_right(times, t), bisect.bisect_right(times, t + window))):
            if hi < least:  # no p99 yet
                continue
            worst = max(worst, float(np.percentile(tpots[min(lo, hi - least):hi], 99)))
    return worst


def simulate(args: EngineArgs, cost: StepCostModel, reqs: list[SimRequest],
             window: float) -> tuple[dict[str, Any], dict]:
    """(the run's summary, its steps and finished requests); `window`: of its windowed p99 TPOT."""
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
    # The duration to the millisecond: under light load configurations differ by the last
    # request's end alone, below what req/s rounded to 4 digits tells apart.
    worst = windowed_p99_tpot(finished, window)
    return {k: round(m[k], 4) for k in keep} | {"num_preemptions": result.num_preemptions,
                                                "windowed_p99_tpot_ms": None if worst is None else round(1000 * worst, 4),
                                                "completed": m["completed"],
                                                "duration_s": round(result.duration_s, 3)}, \
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


def settle_time(w: dict[str, list], change_at: float, bound_ms: float, key: str = "p99_itl_ms") -> Optional[float]:
    """Seconds after the change until the windowed p99 ITL (`key`: or TPOT) stays under
    `bound_ms` to the end; None when the last window is over it (it did not settle within the run)."""
    last_bad, last = change_at, None
    for t, v in zip(w["t"], w[key]):
        if t >= change_at and v is not None:
            last = v
            if v > bound_ms:
                last_bad = t
    return None if last is not None and last > bound_ms else round(last_bad - change_at, 1)


# What "meets the target" asks of a run: p99 TPOT over the whole run (over 100 requests it
# lets the worst one go almost entirely); the windowed p99 TPOT, at every moment of the run as
# `slo` measures it (`windowed_p99_tpot`: this benchmark's reading of issue 14's item 5a through
# its item 1, "keep the windowed p99 of TPOT/ITL under --target-tpot-ms"); and the one `slo`
# holding ITL holds itself to (p99 ITL too: a step is the ITL of every decode row in it, and a
# static pair can meet p99 TPOT by averaging a prompt's long steps into many short ones).
CRITERIA = {"tpot": ("p99_tpot_ms",), "windowed_tpot": ("windowed_p99_tpot_ms",),
            "tpot_and_itl": ("p99_tpot_ms", "p99_itl_ms")}


def throughput(run: dict[str, Any]) -> float:
    """Requests per second from the duration to the millisecond (req/s is rounded to 4 digits)."""
    return run["completed"] / run["duration_s"]


def meets(run: dict[str, Any], criterion: str, target_ms: float) -> Optional[bool]:
    """None: the run has no figure for it (recorded before the criterion existed, or no request
    had two tokens); it is not judged by it."""
    figures = [run.get(k) for k in CRITERIA[criterion]]
    return None if None in figures else all(v <= target_ms for v in figures)


def best_static(statics: Sequence[dict[str, Any]], criterion: str, target_ms: float) -> Optional[dict[str, Any]]:
    """The static run of highest request throughput among those meeting `criterion`; None if none does."""
    return max((r for r in statics if meets(r, criterion, target_ms)), key=throughput, default=None)


def compare(entry: dict[str, Any], target_ms: float) -> dict[str, dict[str, Any]]:
    """Per criterion of CRITERIA: the best static pair of `entry` meeting it, how many met it
    (None: no static run has its figures), whether slo met it (None: no figure), and slo's
    request throughput against that pair's in percent (None when no static pair met it)."""
    out = {}
    for criterion in CRITERIA:
        best = best_static(entry["static"], criterion, target_ms)
        out[criterion] = {
            "best_static": None if best is None else f"{best['max_num_batched_tokens']}/{best['max_num_seqs']}",
            "statics_meeting": None if all(meets(r, criterion, target_ms) is None for r in entry["static"])
            else sum(bool(meets(r, criterion, target_ms)) for r in entry["static"]),
            "slo_meets": meets(entry["slo"], criterion, target_ms),
            "slo_vs_best_pct": None if best is None else round(100 * (throughput(entry["slo"]) / throughput(best) - 1), 3)}
    return out


def sweep(rows: Sequence[TraceRow], scales: Sequence[float], statics: Sequence[tuple[int, int]],
          cost: StepCostModel, slo_args: EngineArgs, target_ms: float, window: float) -> list[dict[str, Any]]:
    """Every static (budget, cap) pair and slo on the trace rows at each rate scale."""
    trace_times = [r.arrival_s for r in rows]
    entries = []
    for scale in scales:
        reqs = requests(rows, [t / scale for t in trace_times])
        entry: dict[str, Any] = {"rate_scale": scale, "offered_rate": round(len(reqs) / reqs[-1].arrival_s, 3),
                                 "static": []}
        for b, s in statics:
            m, _ = simulate(EngineArgs(max_num_batched_tokens=b, max_num_seqs=s), cost, reqs, window)
            entry["static"].append({"max_num_batched_tokens": b, "max_num_seqs": s, **m})
        entry["slo"], _ = simulate(slo_args, cost, reqs, window)
        # The records (`--real` runs the windowed TPOT one by default, the load step all), then the verdicts.
        entry["best_static"] = best_static(entry["static"], "tpot", target_ms)
        entry["best_static_windowed_tpot"] = best_static(entry["static"], "windowed_tpot", target_ms)
        entry["best_static_tpot_and_itl"] = best_static(entry["static"], "tpot_and_itl", target_ms)
        entry["comparison"] = compare(entry, target_ms)
        entries.append(entry)
        slo = entry["slo"]
        print(f"{len(rows)} rows x{scale:g}: slo {throughput(slo):.4f} req/s (p99 TPOT / windowed TPOT / ITL "
              f"{slo['p99_tpot_ms']:.0f} / {slo['windowed_p99_tpot_ms']:.0f} / {slo['p99_itl_ms']:.0f} ms); "
              + "; ".join(
                  f"best static meeting {name}: {c['best_static']} ({c['statics_meeting']} meet), slo "
                  f"{'meets' if c['slo_meets'] else 'MISSES'} it"
                  + ("" if c["slo_vs_best_pct"] is None else f", {c['slo_vs_best_pct']:+.3f}%")
                  for name, c in entry["comparison"].items()), file=sys.stderr)
    return entries


def plot(step_runs: dict[str, dict], change_at: float, target_ms: float, path: Path,
         title: str = "SIMULATED (shipped CPU profile): slo batch control after a load step",
         xlabel: str = "simulated seconds (rate steps up at the dotted line)") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 7), sharex=True)
    w = next(run for name, run in step_runs.items() if name.startswith("slo"))  # its limits (the first slo's)
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
    bottom.set_xlabel(xlabel)
    bottom.set_ylabel("ms")
    bottom.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


TOKENWEIR = [sys.executable, "-m", "tokenweir.cli"]
REAL_KEYS = ("request_throughput", "output_throughput", "p99_tpot_ms", "median_tpot_ms", "p99_itl_ms",
             "median_ttft_ms", "p99_ttft_ms", "duration", "failed")


GAUGES = {"tokenweir:batch_max_num_batched_tokens": "budget", "tokenweir:batch_max_num_seqs": "cap",
          "tokenweir:num_requests_running": "running", "tokenweir:num_requests_waiting": "waiting"}


def poll_gauges(base_url: str, stop: threading.Event, out: list[dict[str, float]], period_s: float = 1.0) -> None:
    """The controller's gauges (and the queue) once a period until `stop`: its limits over time."""
    while not stop.wait(period_s):
        try:
            text = urllib.request.urlopen(f"{base_url}/metrics", timeout=5).read().decode()
        except OSError:  # an answer slower than the timeout under load: the next poll
            continue
        row = {"time": time.time()}
        for line in text.splitlines():
            name = line.split("{", 1)[0]
            if name in GAUGES:
                row[GAUGES[name]] = float(line.rsplit(" ", 1)[1])
        out.append(row)


def serve_and_bench(engine_flags: list[str], workload: list[str], work: Path, name: str,
                    poll: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the run's summary, `bench serve`'s whole result); with `poll` the summary has the gauges
    once a second (`gauge_series`, times from the benchmark's first send)."""
    from tokenweir.profiling.serving import free_port, wait_healthy

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    log = (work / f"{name}.log").open("w")
    server = subprocess.Popen([*TOKENWEIR, "serve", "--port", str(port), *engine_flags], env=env,
                              stdout=log, stderr=subprocess.STDOUT)
    gauges: list[dict[str, float]] = []
    stop = threading.Event()
    poller = threading.Thread(target=poll_gauges, args=(base_url, stop, gauges), daemon=True)
    try:
        wait_healthy(base_url, server)
        if poll:
            poller.start()
        subprocess.run([*TOKENWEIR, "bench", "serve", "--base-url", base_url, "--ignore-eos",
                        "--result-dir", str(work), "--result-filename", f"{name}.json", *workload],
                       env=env, check=True, stdout=subprocess.DEVNULL)
        stop.set()
        if poll:
            poller.join()
        metrics = urllib.request.urlopen(f"{base_url}/metrics").read().decode()
    finally:
        stop.set()
        server.terminate()
        server.wait(timeout=60)
        log.close()
    real = json.loads((work / f"{name}.json").read_text())
    out = {k: round(real[k], 4) for k in REAL_KEYS} | {"engine_flags": engine_flags}
    out["gauges"] = [line for line in metrics.splitlines() if line.startswith("tokenweir:batch_max")]
    lines = [line for line in (work / f"{name}.log").read_text().splitlines() if "Batch limits" in line]
    out["log_lines"] = [line.split("INFO", 1)[-1].strip() for line in (lines if poll else lines[-3:])]
    if poll:
        out["gauge_series"] = [{**g, "time": round(g["time"] - real["start_time"], 2)} for g in gauges]
    return out, real


def measured_series(bench: dict[str, Any], arrivals: Sequence[float], gauges: list[dict[str, float]]) -> dict:
    """A measured run in `windowed`'s form: every inter-token gap a client saw as a step of one
    decode row, starting where the gap starts (as a simulated step starts where its decode rows'
    gap does), with the limits the last poll of the gauges before it showed. Times from the first
    send; a request is sent at its arrival time (no concurrency limit)."""
    poll_t = [g["time"] for g in gauges]
    steps, finished, end = [], [], 0.0
    for arrival, ttft, itls, n in zip(arrivals, bench["ttfts"], bench["itls"], bench["output_lens"]):
        if n == 0:  # failed: no tokens
            continue
        t = arrival + ttft
        for gap in itls:
            g = gauges[max(0, int(np.searchsorted(poll_t, t, side="right")) - 1)] if gauges else {}
            steps.append((t, g.get("budget"), g.get("cap"), 1, gap))
            t += gap
        if n > 1:
            finished.append((t, (t - arrival - ttft) / (n - 1)))
        end = max(end, t)
    steps.sort(key=lambda step: step[0])
    return {"steps": steps, "finished": finished, "end": end}


def client_tpots(bench: dict[str, Any], arrivals: Sequence[float], window: float) -> dict[str, Any]:
    """A real run's TPOTs as its client saw them: (finish, TPOT) per request, each finishing at
    its last token (kept, so another criterion can judge the run later), and their windowed p99."""
    finished = measured_series(bench, arrivals, [])["finished"]
    worst = windowed_p99_tpot(finished, window)
    return {"windowed_p99_tpot_ms": None if worst is None else round(1000 * worst, 4),
            "finished": [[round(t, 4), round(tpot, 6)] for t, tpot in finished]}


def round_order(configs: dict[str, Any], i: int) -> list[str]:
    """The configurations in the order round i runs them: rotated by one per round, so a machine
    that drifts within a command favours none by its place (slo ran first in every round before)."""
    names = list(configs)
    k = i % len(names)
    return names[k:] + names[:k]


def parse_statics(text: str) -> list[tuple[int, int]]:
    """"1024/32,128/64" -> [(1024, 32), (128, 64)] (max_num_batched_tokens / max_num_seqs)."""
    pairs = []
    for item in filter(None, text.split(",")):
        budget, _, cap = item.partition("/")
        pairs.append((int(budget), int(cap)))
    return pairs


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())


def real_configs(ns: argparse.Namespace, sim: dict, scale: float) -> tuple[dict[str, tuple[list[str], EngineArgs]], str]:
    """slo and the static pairs to run against it at `scale`: (name -> (serve flags, the same
    as EngineArgs for the simulator), where the statics came from)."""
    if ns.statics:
        statics, source = parse_statics(ns.statics), "--statics"
    else:  # the best static of the simulated sweep at this rate, else at its highest rate
        simulated = [r for r in sim["rates"] if r["rate_scale"] == scale] or sim["rates"][-1:]
        best = simulated[0].get("best_static_windowed_tpot") or simulated[0]["best_static"]
        statics = [(best["max_num_batched_tokens"], best["max_num_seqs"])]
        source = f"best static of the simulated sweep at x{simulated[0]['rate_scale']:g}"
    profile = [] if ns.slo_cost_profile is None else ["--batch-control-cost-profile", str(ns.slo_cost_profile)]
    configs: dict[str, tuple[list[str], EngineArgs]] = {
        slo_name(hold): (["--batch-controller", "slo", "--target-tpot-ms", f"{ns.target_tpot_ms:g}",
                          "--batch-control-hold", hold, *profile], slo_engine_args(ns.target_tpot_ms, hold))
        for hold in ns.slo_hold.split(",")}
    for b, s in statics:
        configs[f"{b}/{s}"] = (["--max-num-batched-tokens", str(b), "--max-num-seqs", str(s)],
                               EngineArgs(max_num_batched_tokens=b, max_num_seqs=s))
    return configs, source


def slo_name(hold: str) -> str:
    """`slo` holding ITL (the default) is "slo"; holding TPOT, "slo-tpot"."""
    return "slo" if hold == "itl" else f"slo-{hold}"


def step_plot_name(hold: str, target_tpot_ms: float, default_target_ms: float) -> str:
    """The simulated load step's plot: "slo_step.png" for hold itl at the default target, each
    other hold or target its own (a sweep at another target must not overwrite it)."""
    return ("slo_step" + ("" if hold == "itl" else f"_{hold}")
            + ("" if target_tpot_ms == default_target_ms else f"_t{target_tpot_ms:g}") + ".png")


def slo_engine_args(target_tpot_ms: float, hold: str) -> EngineArgs:
    return EngineArgs(batch_controller="slo", target_tpot_ms=target_tpot_ms, batch_control_hold=hold)


def trace_workload(ns: argparse.Namespace, scale: float, *extra: str) -> list[str]:
    return ["--dataset-name", "trace", "--trace-path", str(TRACE), "--num-prompts", str(ns.num_prompts),
            "--rate-scale", f"{scale:g}", *extra, "--max-input-len", str(ns.max_input_len),
            "--max-output-len", str(ns.max_output_len), "--percentile-metrics", "ttft,tpot,itl",
            "--metric-percentiles", "50,99"]


def confirm_real(ns: argparse.Namespace) -> None:
    sim = json.loads(ns.output.read_text())
    cost = load_cost_model(ns.profile)
    window = controller_window(ns.target_tpot_ms)
    work = Path(tempfile.mkdtemp(prefix="batching-slo-"))
    # Earlier runs (an earlier command) are kept: each entry says how and when it was made.
    real: dict[str, Any] = sim.get("real", {"rates": []})
    command = " ".join(["python", "benchmarks/batching_slo.py", *sys.argv[1:]])
    for scale in map(float, filter(None, ns.rate_scales.split(","))):
        configs, source = real_configs(ns, sim, scale)
        workload = trace_workload(ns, scale)
        # The simulator's numbers for this very workload, beside the measured ones.
        rows = read_trace(TRACE, ns.num_prompts, scale, ns.max_input_len, ns.max_output_len)
        arrivals = [r.arrival_s for r in rows]
        reqs = requests(rows, arrivals)
        entry = {"rate_scale": scale, "num_prompts": ns.num_prompts, "command": command, "date": utc_now(),
                 "statics_from": source, "simulated_profile": profile_label(cost, ns.profile),
                 "simulated": {name: simulate(args, cost, reqs, window)[0] for name, (_, args) in configs.items()},
                 "window_s": window, "rounds": []}
        real["rates"].append(entry)  # after the earlier runs of this rate: those made with older code stay
        # Interleaved rounds (every configuration once per round): on a shared machine a
        # difference counts only if it holds in each round.
        for i in range(ns.repeats):
            results = {}
            for name in round_order(configs, i):
                out, bench = serve_and_bench(configs[name][0], workload, work, f"{name.replace('/', '-')}-{scale:g}-{i}")
                results[name] = out | client_tpots(bench, arrivals, window)
                print(f"x{scale:g} round {i} {name}: {out['request_throughput']:.4f} req/s, p99 TPOT "
                      f"{out['p99_tpot_ms']:.0f} ms, windowed {results[name]['windowed_p99_tpot_ms']} ms",
                      file=sys.stderr, flush=True)
            entry["rounds"].append({name: results[name] for name in configs})
            sim["real"] = real  # written after every round: a cut-off command keeps what it measured
            ns.output.write_text(json.dumps(sim, indent=1) + "\n")
        print(json.dumps(entry, indent=1), file=sys.stderr)
    if ns.step_scales is not None:
        confirm_real_step(ns, sim, real, cost, work, command)


def confirm_real_step(ns: argparse.Namespace, sim: dict, real: dict[str, Any], cost: StepCostModel,
                      work: Path, command: str) -> None:
    """The load step on the real engine: the trace rows at one rate, the second half at another
    (`bench serve --rate-step`), slo against the statics, each run's windowed p99 ITL from the
    client's inter-token gaps and its limits from the gauges, polled once a second."""
    before, after = map(float, ns.step_scales.split(","))
    rows = read_trace(TRACE, ns.num_prompts, 1.0, ns.max_input_len, ns.max_output_len)
    half = len(rows) // 2
    arrivals = rate_step_arrivals([r.arrival_s for r in rows], half, before, after)
    change_at = arrivals[half]
    window = controller_window(ns.target_tpot_ms)
    configs, source = real_configs(ns, sim, after)
    workload = trace_workload(ns, before, "--rate-step", f"{half}:{after:g}")
    reqs = requests(rows, arrivals)
    simulated = {}
    for name, (_, args) in configs.items():
        metrics, raw = simulate(args, cost, reqs, window)
        w = windowed(raw, window)
        simulated[name] = metrics | {"settle_s": settle_time(w, change_at, ns.target_tpot_ms),
                                     "settle_tpot_s": settle_time(w, change_at, ns.target_tpot_ms, "p99_tpot_ms")}
    entry: dict[str, Any] = {"scale_before": before, "scale_after": after, "at_index": half,
                             "num_prompts": ns.num_prompts, "change_at_s": round(change_at, 2),
                             "window_s": window, "command": command, "date": utc_now(), "statics_from": source,
                             "simulated_profile": profile_label(cost, ns.profile), "simulated": simulated,
                             "rounds": []}
    real.setdefault("steps", []).append(entry)
    for i in range(ns.repeats):
        runs = {}
        for name in round_order(configs, i):
            out, bench = serve_and_bench(configs[name][0], workload, work, f"step-{name.replace('/', '-')}-{i}", poll=True)
            w = windowed(measured_series(bench, arrivals, out["gauge_series"]), window)
            after_step = [v for t, v in zip(w["t"], w["p99_itl_ms"]) if t >= change_at and v is not None]
            runs[name] = out | client_tpots(bench, arrivals, window) | {
                "settle_s": settle_time(w, change_at, ns.target_tpot_ms),
                "settle_within_5pct_s": settle_time(w, change_at, 1.05 * ns.target_tpot_ms),
                # Holding TPOT, a step may outlast the target by design: what settles is the p99 TPOT.
                "settle_tpot_s": settle_time(w, change_at, ns.target_tpot_ms, "p99_tpot_ms"),
                "points_after_step": len(after_step),  # of windowed's 300 time points
                "points_after_step_over_target": sum(v > ns.target_tpot_ms for v in after_step),
                "series": w}
        entry["rounds"].append({name: runs[name] for name in configs})
        sim["real"] = real
        ns.output.write_text(json.dumps(sim, indent=1) + "\n")
        holds = "" if ns.slo_hold == "itl" else f"_{ns.slo_hold.replace(',', '_')}"
        plot({name: runs[name]["series"] for name in configs}, change_at, ns.target_tpot_ms,
             OUT / "batching_plots" / f"slo_step_real{holds}_{i + 1}.png",
             title=f"real engine (tokenweir serve, round {i + 1}): slo after a load step "
                   f"x{before:g} -> x{after:g}",
             xlabel="seconds from the first request (rate steps up at the dotted line)")
    print(json.dumps({k: v for k, v in entry.items() if k != "rounds"} | {"rounds": [
        {name: {k: v for k, v in run.items() if k not in ("series", "gauge_series", "log_lines")}
         for name, run in runs.items()} for runs in entry["rounds"]]}, indent=1), file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", type=Path, default=None)
    ap.add_argument("--target-tpot-ms", type=float, default=250.0)
    ap.add_argument("--rate-scales", default="0.1,0.2,0.3,0.4")
    ap.add_argument("--step-scales", default=None,
                    help="rate scale before,after the step (default 0.1,0.4; empty: none; --real: the "
                         "step runs only when this is given)")
    ap.add_argument("--num-prompts", type=int, default=300)
    ap.add_argument("--short-sweep", default="100:0.4,1.5,3",
                    help="simulated: a second sweep, N_PROMPTS:RATE_SCALES (default: the real-engine runs' "
                         "workloads); empty for none")
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)),
                    help="simulated: the static max_num_batched_tokens swept")
    ap.add_argument("--caps", default=",".join(map(str, CAPS)), help="simulated: the static max_num_seqs swept")
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--max-output-len", type=int, default=256)
    ap.add_argument("--output", type=Path, default=OUT / "batching_slo.json")
    ap.add_argument("--real", action="store_true", help="confirm on the real engine (see above)")
    ap.add_argument("--repeats", type=int, default=1, help="--real: rounds per rate (slo and each static, the order rotated per round)")
    ap.add_argument("--slo-cost-profile", type=Path, default=None,
                    help="--real: the profile slo's predictions start from on the server "
                         "(--batch-control-cost-profile; default: the shipped one)")
    ap.add_argument("--slo-hold", default="itl",
                    help="what slo holds (--batch-control-hold): itl or tpot; with --real a list, e.g. "
                         "itl,tpot, each run in every round")
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
    if "," in ns.slo_hold:
        raise SystemExit("--slo-hold: one value for the simulated sweep (several only with --real)")
    slo_args = slo_engine_args(ns.target_tpot_ms, ns.slo_hold)
    window = controller_window(ns.target_tpot_ms)
    budgets, caps = ([int(x) for x in text.split(",")] for text in (ns.budgets, ns.caps))
    statics = [(b, s) for b in budgets for s in caps if s <= b]
    result: dict[str, Any] = {"simulated": True, "profile": profile_label(cost, ns.profile),
                              "target_tpot_ms": ns.target_tpot_ms, "num_prompts": ns.num_prompts,
                              "max_input_len": ns.max_input_len, "max_output_len": ns.max_output_len,
                              "criteria": {k: list(v) for k, v in CRITERIA.items()},
                              "rates": sweep(rows, [float(x) for x in ns.rate_scales.split(",") if x], statics, cost,
                                             slo_args, ns.target_tpot_ms, window)}
    if ns.short_sweep:
        n, _, scales = ns.short_sweep.partition(":")
        short_rows = read_trace(TRACE, int(n), 1.0, ns.max_input_len, ns.max_output_len)
        result["short_sweep"] = {"num_prompts": int(n), "rates": sweep(
            short_rows, [float(x) for x in scales.split(",")], statics, cost, slo_args, ns.target_tpot_ms, window)}
    if ns.output.exists():  # the real-engine runs of `--real` stay
        result["real"] = json.loads(ns.output.read_text()).get("real", {"rates": []})
    if ns.step_scales == "":
        ns.output.write_text(json.dumps(result, indent=1) + "\n")
        return
    before, after = map(float, (ns.step_scales or "0.1,0.4").split(","))
    half = len(rows) // 2
    step_times = rate_step_arrivals(trace_times, half, before, after)
    reqs = requests(rows, step_times)
    change_at = step_times[half]
    step: dict[str, Any] = {"scale_before": before, "scale_after": after, "change_at_s": round(change_at, 2)}
    series = {}
    step["slo"], raw = simulate(slo_args, cost, reqs, window)
    series["slo"] = windowed(raw, window)
    step["slo_settle_s"] = settle_time(series["slo"], change_at, ns.target_tpot_ms)
    step["slo_settle_within_5pct_s"] = settle_time(series["slo"], change_at, 1.05 * ns.target_tpot_ms)
    # Holding TPOT, a step may outlast the target by design: what settles is the p99 TPOT.
    step["slo_settle_tpot_s"] = settle_time(series["slo"], change_at, ns.target_tpot_ms, "p99_tpot_ms")
    # Against the best static pairs at the rate after the step, by each criterion.
    for key, name in (("static", "best_static"), ("static_windowed_tpot", "best_static_windowed_tpot"),
                      ("static_tpot_and_itl", "best_static_tpot_and_itl")):
        best = result["rates"][-1][name] if result["rates"] else None
        if best is None:
            continue
        b, s = best["max_num_batched_tokens"], best["max_num_seqs"]
        label = f"static {b}/{s}"
        if label not in series:  # the same pair may be best by several
            step[key], raw = simulate(EngineArgs(max_num_batched_tokens=b, max_num_seqs=s), cost, reqs, window)
            series[label] = windowed(raw, window)
            step[key] |= {"max_num_batched_tokens": b, "max_num_seqs": s,
                          "settle_s": settle_time(series[label], change_at, ns.target_tpot_ms),
                          "settle_tpot_s": settle_time(series[label], change_at, ns.target_tpot_ms, "p99_tpot_ms")}
    step["series"] = series
    result["step"] = step
    plot(series, change_at, ns.target_tpot_ms,
         OUT / "batching_plots" / step_plot_name(ns.slo_hold, ns.target_tpot_ms, ap.get_default("target_tpot_ms")),
         title=f"SIMULATED (shipped CPU profile): slo (hold {ns.slo_hold}, target {ns.target_tpot_ms:g} ms) "
               "batch control after a load step")
    ns.output.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in step.items() if k != "series"}, indent=1))


if __name__ == "__main__":
    main()

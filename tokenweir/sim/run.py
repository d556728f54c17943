"""`tokenweir simulate`: replay a `bench serve` workload through a simulated engine.

The flags are the engine's (vLLM names, as `serve` takes them) and `bench serve`'s workload and
result flags; the workload is built by `bench serve`'s own code and scored by its metric code,
so the printed table and the JSON keys are those of `bench serve`. Every output is marked as
simulated and names the profile it used. Outputs have exactly the workload's lengths, as with
`bench serve --ignore-eos`; a request the server would refuse for its length (prompt and output
over max_model_len) fails, as it would there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from tokenweir.bench import serve as bench
from tokenweir.bench.serve_metrics import BenchmarkMetrics, compute_metrics, metrics_to_dict
from tokenweir.bench.serve_report import format_table
from tokenweir.bench.slo_mix import SLOClass, class_report, format_class_table
from tokenweir.config import EngineArgs
from tokenweir.request import SchedulingHints
from tokenweir.core.cost_model import DEFAULT_PROFILE, StepCostModel, load_cost_model
from tokenweir.cluster.config import cluster_config_from
from tokenweir.cluster.dispatch import cluster_fields
from tokenweir.sim.cluster import ClusterSimulator
from tokenweir.sim.simulator import SimRequest, SimResult, Simulator


def add_sim_args(parser: argparse.ArgumentParser, search: bool = False) -> None:
    group = parser.add_argument_group("simulation")
    group.add_argument("--profile", type=Path, default=None,
                       help=f"step cost profile from `tokenweir profile`; default: the shipped "
                            f"{DEFAULT_PROFILE.name}")
    if search:  # many runs, scored only: no series, plots or progress bar
        parser.set_defaults(timeseries_points=1)
        return
    group.add_argument("--timeseries-points", type=int, default=500,
                       help="the time series are averaged into at most this many points")
    group.add_argument("--plot-dir", type=Path, default=None,
                       help="write PNG plots (latency CDFs, time series) into this folder")
    group.add_argument("--wall-time", action=argparse.BooleanOptionalAction, default=True,
                       help="record wall_seconds in the result; --no-wall-time leaves it out, "
                            "so that equal inputs give byte-identical files")
    group.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def sim_requests(workload: bench.Workload, classes: Sequence[SLOClass] = ()) -> list[SimRequest]:
    """The workload's requests; with --slo-mix classes, each with its class's hints."""
    hints = [c.hints() for c in classes] or [SchedulingHints()] * len(workload.requests)
    return [SimRequest(f"sim-{i}", r.prompt_token_ids, r.output_len, float(t), h)
            for i, (r, t, h) in enumerate(zip(workload.requests, workload.arrivals, hints))]


def profile_label(cost_model: StepCostModel, path: Optional[Path]) -> dict[str, Any]:
    meta = cost_model.metadata
    return {"path": str(path) if path is not None else f"(shipped) {DEFAULT_PROFILE.name}",
            **{k: meta.get(k) for k in ("model", "dtype", "device", "device_name", "measured_at")}}


def simulate(args: EngineArgs, ns: argparse.Namespace, cost_model: StepCostModel,
             show_progress: bool = False) -> tuple[SimResult, float]:
    """Build the workload `ns` describes and run it; returns the result and the wall seconds."""
    bench.check_counts(ns)
    workload = bench.build_workload(ns, bench.load_tokenizer(ns.tokenizer))
    requests = sim_requests(workload, bench.slo_classes_of(ns, len(workload.requests)))
    cluster = cluster_config_from(ns)
    simulator: Union[Simulator, ClusterSimulator] = (
        ClusterSimulator.from_engine_args(args, cluster, cost_model, ns.timeseries_points)
        if cluster.data_parallel_size > 1 else Simulator.from_engine_args(args, cost_model, ns.timeseries_points))
    start = time.perf_counter()
    if show_progress:
        from tqdm import tqdm

        with tqdm(total=len(requests), desc="simulated requests", unit="req", file=sys.stderr) as bar:
            def progress(done: int) -> None:
                bar.update(done - bar.n)

            result = simulator.run(requests, ns.max_concurrency, progress)
    else:
        result = simulator.run(requests, ns.max_concurrency)
    return result, time.perf_counter() - start


def result_dict(result: SimResult, metrics: BenchmarkMetrics, ns: argparse.Namespace, args: EngineArgs,
                cost_model: StepCostModel, wall_seconds: Optional[float], selected: list[str],
                slos: dict[str, float]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "simulated": True,
        "profile": profile_label(cost_model, ns.profile),
        "dataset_name": ns.dataset_name,
        "num_prompts": ns.num_prompts,
        "request_rate": bench.request_rate_field(ns),
        "burstiness": ns.burstiness,
        "max_concurrency": ns.max_concurrency,
        "seed": ns.seed,
        "goodput_slos_ms": slos or None,
        **metrics_to_dict(metrics, selected),
        "simulated_seconds": result.duration_s,
        "num_steps": result.num_steps,
        "num_preemptions": result.num_preemptions,
        "engine_args": {k: getattr(args, k) for k in EngineArgs.field_names()},
        "input_lens": [r.prompt_len for r in result.records],
        "output_lens": [r.output_tokens if r.success else 0 for r in result.records],
        "ttfts": [r.ttft for r in result.records],
        "e2els": [r.latency for r in result.records],
        "errors": [r.error for r in result.records],
        "timeseries": result.timeseries.to_dict(),
    }
    classes = bench.slo_classes_of(ns, len(result.records))
    if classes:
        out["slo_classes"] = class_report(result.records, classes, result.duration_s)
    out.update(cluster_fields(cluster_config_from(ns)))
    if wall_seconds is not None:
        out["wall_seconds"] = wall_seconds
        out["simulated_seconds_per_wall_second"] = result.duration_s / wall_seconds
        out["steps_per_wall_second"] = result.num_steps / wall_seconds
    if ns.dataset_name == "trace":
        out["trace_path"] = str(ns.trace_path)
        out["rate_scale"] = ns.rate_scale
        if ns.rate_step is not None:
            out["rate_step"] = ns.rate_step
    return out


def on_profiled_machine(args: EngineArgs, profile: Optional[Path]) -> EngineArgs:
    """The engine args as the simulated machine, the profile's, runs them: sla's SLO guard
    predicts its steps with that profile, as `serve --sla-cost-profile` would there (unless
    told otherwise). Its step-time correction would scale another profile to this one, but not
    reshape it."""
    if profile is not None and args.scheduling_policy == "sla" and args.sla_cost_profile is None:
        return dataclasses.replace(args, sla_cost_profile=str(profile))
    return args


def main(ns: argparse.Namespace, args: EngineArgs) -> dict[str, Any]:
    slos = bench.parse_goodput(ns.goodput)
    selected = bench.parse_selected_metrics(ns.percentile_metrics)
    percentiles = bench.parse_percentiles(ns.metric_percentiles)
    cost_model = load_cost_model(ns.profile)
    args = on_profiled_machine(args, ns.profile)
    result, wall = simulate(args, ns, cost_model, show_progress=not ns.disable_tqdm)
    metrics = compute_metrics(result.records, result.duration_s, percentiles, slos)
    rate = bench.request_rate_field(ns)
    rate_label = rate if isinstance(rate, str) else f"{rate:g}"
    label = profile_label(cost_model, ns.profile)
    print(f"SIMULATED with profile {label['path']} ({label['model']}, {label['dtype']} on "
          f"{label['device']}, measured {label['measured_at']})")
    print(format_table(metrics, selected, ns.max_concurrency, rate_label))
    classes = bench.slo_classes_of(ns, len(result.records))
    if classes:
        print(format_class_table(class_report(result.records, classes, result.duration_s)))
    print(f"simulated {result.duration_s:.1f} s in {wall:.2f} s of wall time "
          f"({result.duration_s / wall:.0f}x real time, {result.num_steps / wall:.0f} steps/s); "
          f"{result.num_steps} steps, {result.num_preemptions} preemptions")
    data = result_dict(result, metrics, ns, args, cost_model, wall if ns.wall_time else None,
                       selected, slos)
    if ns.save_result or ns.result_filename:
        path = bench.result_path(ns, label["model"] or "model", rate_label, kind="simulated")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")
        print(f"Saved result to {path}", file=sys.stderr)
    if ns.plot_dir is not None:
        from tokenweir.sim.plots import write_plots

        for path in write_plots(data, result.records, ns.plot_dir):
            print(f"wrote {path}", file=sys.stderr)
    return data

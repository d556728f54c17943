"""`tokenweir simulate search`: the highest request rate each engine configuration sustains.

A configuration sustains a rate when at least `attainment` (0.9) of its requests meet every
SLO (DistServe's goodput criterion), counting failed requests as misses. Attainment falls as
the rate rises (queues grow), so the capacity is found by doubling the rate until it fails and
bisecting between the last rate that passed and the first that failed. For the trace dataset
the rate is the trace's `--rate-scale`; otherwise `--request-rate` in requests per second.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenweir.bench import serve as bench
from tokenweir.bench.serve_metrics import is_good
from tokenweir.config import EngineArgs
from tokenweir.core.cost_model import StepCostModel, load_cost_model
from tokenweir.sim.run import profile_label, simulate


@dataclass(frozen=True, slots=True)
class Capacity:
    overrides: dict[str, Any]  # the engine args this configuration sets
    rate: float  # the highest passing rate found; 0 if even the lowest tried failed
    attainment_at_rate: float
    num_simulations: int


def find_capacity(attainment: Callable[[float], float], target: float, start: float,
                  iterations: int, max_rate: float = 1e6) -> tuple[float, float, int]:
    """(highest passing rate, its attainment, simulations run) for a rate -> attainment function
    that falls as the rate rises. Doubles from `start`, then bisects `iterations` times."""
    if not start > 0:
        raise ValueError(f"search start rate must be > 0, got {start}")
    runs = 0
    low, low_value = 0.0, 0.0
    rate = start
    # Halve until the start passes (a start above capacity), then double until one fails.
    while True:
        value = attainment(rate)
        runs += 1
        if value >= target:
            low, low_value = rate, value
            break
        rate /= 2
        if rate < start / 1024:
            return 0.0, value, runs
    high = None
    while high is None:
        rate = low * 2
        if rate > max_rate:
            return low, low_value, runs
        value = attainment(rate)
        runs += 1
        if value >= target:
            low, low_value = rate, value
        else:
            high = rate
    for _ in range(iterations):
        mid = (low + high) / 2
        value = attainment(mid)
        runs += 1
        if value >= target:
            low, low_value = mid, value
        else:
            high = mid
    return low, low_value, runs


def engine_grid(base: EngineArgs, lists: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Every combination of the swept engine args, in flag order."""
    names = list(lists)
    return [dict(zip(names, combo)) for combo in itertools.product(*(lists[n] for n in names))]


def attainment_of(ns: argparse.Namespace, args: EngineArgs, cost_model: StepCostModel,
                  slos: dict[str, float]) -> Callable[[float], float]:
    def at(rate: float) -> float:
        run_ns = copy.copy(ns)
        if ns.dataset_name == "trace":
            run_ns.rate_scale = rate
        else:
            run_ns.request_rate = rate
        result, _ = simulate(args, run_ns, cost_model)
        return sum(is_good(r, slos) for r in result.records) / len(result.records)
    return at


def search(ns: argparse.Namespace, base: EngineArgs, lists: dict[str, list[Any]],
           progress: Callable[[str], None] = lambda s: None) -> tuple[list[Capacity], StepCostModel]:
    slos = bench.parse_goodput(ns.goodput)
    if not slos:
        raise ValueError("simulate search needs SLOs: --goodput ttft:MS tpot:MS (and/or e2el:MS)")
    if not 0 < ns.attainment <= 1:
        raise ValueError(f"--attainment must be in (0, 1], got {ns.attainment}")
    cost_model = load_cost_model(ns.profile)
    start = ns.start_rate or (ns.rate_scale if ns.dataset_name == "trace" else 1.0)
    capacities = []
    for overrides in engine_grid(base, lists):
        args = EngineArgs(**{**{k: getattr(base, k) for k in EngineArgs.field_names()}, **overrides})
        progress(f"searching {overrides or 'the base configuration'}")
        rate, value, runs = find_capacity(attainment_of(ns, args, cost_model, slos), ns.attainment,
                                          start, ns.search_iterations)
        capacities.append(Capacity(overrides, rate, value, runs))
    # Highest capacity first; ties keep the grid's order (sorted is stable).
    return sorted(capacities, key=lambda c: -c.rate), cost_model


def format_capacities(capacities: Sequence[Capacity], rate_name: str, attainment: float) -> str:
    keys = list(capacities[0].overrides) if capacities else []
    header = [*keys, rate_name, f"attainment"]
    rows = [[*(str(c.overrides[k]) for k in keys), f"{c.rate:.4g}", f"{c.attainment_at_rate:.1%}"]
            for c in capacities]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = [f"SIMULATED capacity: the highest {rate_name} at which >= {attainment:.0%} of "
             "requests meet every SLO",
             "  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def main(ns: argparse.Namespace, base: EngineArgs, lists: dict[str, list[Any]]) -> dict[str, Any]:
    rate_name = "rate_scale" if ns.dataset_name == "trace" else "request_rate"
    capacities, cost_model = search(ns, base, lists, lambda s: print(s, file=sys.stderr))
    print(format_capacities(capacities, rate_name, ns.attainment))
    data = {
        "simulated": True,
        "profile": profile_label(cost_model, ns.profile),
        "dataset_name": ns.dataset_name,
        "num_prompts": ns.num_prompts,
        "seed": ns.seed,
        "goodput_slos_ms": bench.parse_goodput(ns.goodput),
        "attainment": ns.attainment,
        "rate_name": rate_name,
        "capacities": [{"engine_args": c.overrides, rate_name: c.rate,
                        "attainment_at_rate": c.attainment_at_rate,
                        "num_simulations": c.num_simulations} for c in capacities],
    }
    if ns.result_filename:
        path = Path(ns.result_dir) / ns.result_filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")
        print(f"Saved result to {path}", file=sys.stderr)
    return data

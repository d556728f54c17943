"""`tokenweir simulate search`: the highest request rate each engine configuration sustains.

A configuration sustains a rate when at least `attainment` (0.9) of its requests meet every
SLO (DistServe's goodput criterion), counting failed requests as misses, or, with
`--slo-percentiles`, when each named latency percentile is within its bound. Attainment falls as
the rate rises (queues grow), so the capacity is found by doubling the rate until it fails and
bisecting between the last rate that passed and the first that failed. For the trace dataset
the rate is the trace's `--rate-scale`; otherwise `--request-rate` in requests per second.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenweir.bench import serve as bench
import numpy as np

from tokenweir.bench.serve_metrics import SLO_NAMES, RequestRecord, is_good
from tokenweir.cluster.config import cluster_config_from
from tokenweir.cluster.dispatch import cluster_fields
from tokenweir.config import EngineArgs
from tokenweir.core.cost_model import StepCostModel, load_cost_model
from tokenweir.sim.run import on_profiled_machine, profile_label, simulate


@dataclass(frozen=True, slots=True)
class Capacity:
    overrides: dict[str, Any]  # the engine args this configuration sets
    rate: float  # the highest passing rate found; 0 if even the lowest tried failed
    score: float  # the criterion's score at that rate (attainment, or worst percentile / bound)
    num_simulations: int


def find_capacity(passes: Callable[[float], tuple[bool, float]], start: float,
                  iterations: int, max_rate: float = 1e6) -> tuple[float, float, int]:
    """(highest passing rate, its score, simulations run) for a rate -> (passes, score) test
    that fails from some rate on. Halves from `start` until a rate passes, doubles until one
    fails, then bisects `iterations` times."""
    if not start > 0:
        raise ValueError(f"search start rate must be > 0, got {start}")
    runs = 0
    passing: tuple[float, float] | None = None  # (rate, score) of the highest rate that passed
    failing: float | None = None  # the lowest rate that failed

    def probe(rate: float) -> None:
        nonlocal runs, passing, failing
        ok, score = passes(rate)
        runs += 1
        if ok:
            passing = (rate, score)
        else:
            failing = rate if failing is None else min(failing, rate)

    rate = start
    while passing is None:  # halve until a rate passes
        probe(rate)
        rate /= 2
        if passing is None and rate < start / 1024:
            return 0.0, 0.0, runs
    while failing is None:  # double until one fails
        if passing[0] * 2 > max_rate:
            return passing[0], passing[1], runs
        probe(passing[0] * 2)
    for _ in range(iterations):
        probe((passing[0] + failing) / 2)
    return passing[0], passing[1], runs


class GoodputCriterion:
    """DistServe's: at least `attainment` of all requests meet every SLO (failures miss)."""

    score_name = "attainment"

    def __init__(self, slos_ms: dict[str, float], attainment: float) -> None:
        if not 0 < attainment <= 1:
            raise ValueError(f"--attainment must be in (0, 1], got {attainment}")
        self.slos_ms, self.attainment = slos_ms, attainment

    def evaluate(self, records: Sequence[RequestRecord]) -> tuple[bool, float]:
        share = sum(is_good(r, self.slos_ms) for r in records) / len(records)
        return share >= self.attainment, share

    def describe(self) -> str:
        slos = ", ".join(f"{k} <= {v:g} ms" for k, v in self.slos_ms.items())
        return f">= {self.attainment:.0%} of requests meet {slos}"


class PercentileCriterion:
    """Each given latency percentile stays within its bound, e.g. TTFT p90 <= 2 s and TPOT
    p99 <= 100 ms. Failed requests count as infinitely late. The score is the worst
    percentile / bound ratio (<= 1 passes)."""

    score_name = "worst p/bound"

    def __init__(self, targets: list[tuple[str, float, float]]) -> None:
        self.targets = targets

    @classmethod
    def parse(cls, items: list[str]) -> PercentileCriterion:
        targets = []
        for item in items:
            parts = item.split(":")
            try:
                name, pct, bound = parts[0], float(parts[1].removeprefix("p")), float(parts[2])
            except (IndexError, ValueError):
                raise ValueError(f"bad --slo-percentiles item {item!r}; use METRIC:pNN:MS, e.g. ttft:p90:2000") from None
            if len(parts) != 3 or name not in SLO_NAMES or not 0 < pct <= 100 or not bound > 0:
                raise ValueError(f"bad --slo-percentiles item {item!r}; METRIC in {SLO_NAMES}, "
                                 "a percentile in (0, 100] and a bound > 0 ms")
            targets.append((name, pct, bound))
        return cls(targets)

    def evaluate(self, records: Sequence[RequestRecord]) -> tuple[bool, float]:
        worst = 0.0
        for name, pct, bound in self.targets:
            values = [(getattr(r, name) if name != "e2el" else r.latency) if r.success else math.inf
                      for r in records]
            values = [v if v is not None else 0.0 for v in values]  # a 1-token output has no TPOT
            worst = max(worst, float(np.percentile(np.asarray(values) * 1000.0, pct, method="higher")) / bound)
        return worst <= 1.0, worst

    def describe(self) -> str:
        return " and ".join(f"{n.upper()} p{p:g} <= {b:g} ms" for n, p, b in self.targets)


def make_criterion(ns: argparse.Namespace) -> GoodputCriterion | PercentileCriterion:
    if ns.slo_percentiles and ns.goodput:
        raise ValueError("give either --goodput (with --attainment) or --slo-percentiles, not both")
    if ns.slo_percentiles:
        return PercentileCriterion.parse(ns.slo_percentiles)
    slos = bench.parse_goodput(ns.goodput)
    if not slos:
        raise ValueError("simulate search needs SLOs: --goodput ttft:MS tpot:MS (with --attainment), "
                         "or --slo-percentiles ttft:p90:MS tpot:p99:MS")
    return GoodputCriterion(slos, ns.attainment)


def engine_grid(lists: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Every combination of the swept engine args, in flag order."""
    names = list(lists)
    return [dict(zip(names, combo)) for combo in itertools.product(*(lists[n] for n in names))]


def search(ns: argparse.Namespace, base: EngineArgs, lists: dict[str, list[Any]],
           progress: Callable[[str], None] = lambda s: None) -> tuple[list[Capacity], StepCostModel]:
    criterion = make_criterion(ns)
    if ns.rate_step is not None:  # the search scales one rate; the step's second one would stay
        raise ValueError("simulate search varies the rate; it takes no --rate-step")
    cost_model = load_cost_model(ns.profile)
    if ns.dataset_name == "trace":
        start = ns.start_rate or ns.rate_scale
    else:
        start = ns.start_rate or (ns.request_rate if math.isfinite(ns.request_rate) else 1.0)
    capacities = []
    for overrides in engine_grid(lists):
        args = on_profiled_machine(dataclasses.replace(base, **overrides), ns.profile)

        def passes(rate: float) -> tuple[bool, float]:
            run_ns = copy.copy(ns)
            setattr(run_ns, "rate_scale" if ns.dataset_name == "trace" else "request_rate", rate)
            result, _ = simulate(args, run_ns, cost_model)
            return criterion.evaluate(result.records)

        progress(f"searching {overrides or 'the base configuration'}")
        rate, score, runs = find_capacity(passes, start, ns.search_iterations)
        capacities.append(Capacity(overrides, rate, score, runs))
    # Highest capacity first; ties keep the grid's order (sorted is stable).
    return sorted(capacities, key=lambda c: -c.rate), cost_model


def format_capacities(capacities: Sequence[Capacity], rate_name: str,
                      criterion: GoodputCriterion | PercentileCriterion) -> str:
    keys = list(capacities[0].overrides) if capacities else []
    header = [*keys, rate_name, criterion.score_name]
    rows = [[*(str(c.overrides[k]) for k in keys), f"{c.rate:.4g}", f"{c.score:.3f}"]
            for c in capacities]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    lines = [f"SIMULATED capacity: the highest {rate_name} at which {criterion.describe()}",
             "  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows]
    return "\n".join(lines)


def main(ns: argparse.Namespace, base: EngineArgs, lists: dict[str, list[Any]]) -> dict[str, Any]:
    rate_name = "rate_scale" if ns.dataset_name == "trace" else "request_rate"
    criterion = make_criterion(ns)
    capacities, cost_model = search(ns, base, lists, lambda s: print(s, file=sys.stderr))
    print(format_capacities(capacities, rate_name, criterion))
    data = {
        "simulated": True,
        "profile": profile_label(cost_model, ns.profile),
        "dataset_name": ns.dataset_name,
        "num_prompts": ns.num_prompts,
        "seed": ns.seed,
        "criterion": criterion.describe(),
        "rate_name": rate_name,
        **cluster_fields(cluster_config_from(ns)),
        "capacities": [{"engine_args": c.overrides, rate_name: c.rate, criterion.score_name: c.score,
                        "num_simulations": c.num_simulations} for c in capacities],
    }
    if ns.result_filename:
        path = Path(ns.result_dir) / ns.result_filename
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")
        print(f"Saved result to {path}", file=sys.stderr)
    return data

"""`sla` and `vtc` in the simulator (SIMULATED: the shipped CPU profile of SmolLM2-135M, the real
Scheduler): the overload mix and the two tenants of docs/benchmarks/sla.md over several seeds
and rates.

The capacity at this shape is measured first (fcfs, every request sent at once); each rate is a
multiple of it. (a) 30% interactive + 70% batch under fcfs, priority and sla (and sla without
its SLO guard, and with the defaults of an earlier session, for comparison), in two shapes of
interactive SLOs: the first evaluation's (TTFT 2 s, TPOT 250 ms) and a tight one (TTFT 1 s,
TPOT 150 ms: under twice the 87 ms decode step of a full batch of 32, half a step with one
300-token prefill); (b) two tenants, one sending 10x the other's requests, under fcfs and vtc;
(c) sla's SLO guard given a wrong profile (the shipped one with every time x0.2 and x5, a
profile file built here) with and without its measured step-time correction, in the tight
shape at x1.5 (the simulated machine stays the shipped profile); (d) "backlogged": the two
tenants with the light one's own load above half the capacity (x0.75, heavy x7.5: both
backlogged) over a fixed arrival window, run in this process with a step observer
(`TenantServiceLog`) that records each step's service per tenant and which tenants are
backlogged, so that shares are measured while both are, and under vtc the counters' gap is
checked against VTC's bound; (e) "unmeetable": 70% of the requests with a deadline (priority
0), 30% without (priority 1), under sla
with --sla-drop-expired against --sla-drop-unmeetable (and no shedding), run in this process
with a step observer that counts the tokens computed for requests that end up shed. Writes
docs/benchmarks/sla_sim.json and prints markdown.

    .venv/bin/python benchmarks/sla_sim.py [--loads 1.5 2 3] [--seeds 1 2 3] [--parts wrong-profile]
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from collections.abc import Sequence
from pathlib import Path
from typing import Optional

from tokenweir.bench import serve as bench
from tokenweir.bench.serve import Workload
from tokenweir.bench.serve_metrics import RequestRecord
from tokenweir.bench.slo_mix import SLOClass, class_report
from tokenweir.cli import SIM_SKIPPED_ENGINE_ARGS, build_parser, engine_args_from
from tokenweir.core.cost_model import StepCostModel, load_cost_model
from tokenweir.core.policies.fair_share import VirtualTokenCounters, VTCConfig
from tokenweir.core.scheduler import Scheduler, SchedulerOutput
from tokenweir.sim.run import profile_label, sim_requests
from tokenweir.sim.simulator import Simulator

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks"
WORKLOAD = ["--num-prompts", "3000", "--random-input-len", "256", "--random-output-len", "64",
            "--random-range-ratio", "0.5", "--max-num-seqs", "32", "--no-wall-time"]
BATCH = "batch:0.7:priority=1:ttft=60000:tpot=1000"
SHAPES = {"ttft 2 s, tpot 250 ms": ["interactive:0.3:priority=0:ttft=2000:tpot=250", BATCH],
          "tight: ttft 1 s, tpot 150 ms": ["interactive:0.3:priority=0:ttft=1000:tpot=150", BATCH]}
TENANT_MIX = ["heavy:10:tenant=heavy", "light:1:tenant=light"]
# The defaults before base_weight 10 and aging_rate 0.01, before the SLO guard and before KV
# usage entered the load (docs/benchmarks/sla.md says why).
POLICIES = {"fcfs": ["--scheduling-policy", "fcfs"], "priority": ["--scheduling-policy", "priority"],
            "sla": ["--scheduling-policy", "sla"],
            "sla, no SLO guard": ["--scheduling-policy", "sla", "--no-sla-protect-slos"],
            "sla (old defaults)": ["--scheduling-policy", "sla", "--sla-base-weight", "1", "--sla-aging-rate", "0.001",
                                   "--no-sla-protect-slos", "--sla-kv-load-weight", "0"]}
# (c): the guard's profile is the shipped one with every step time scaled by these factors
# (x0.2: it believes the machine 5x faster than it is; x5: 5x slower), with its correction
# on and off; at this shape and load.
WRONG_SCALES = (0.2, 5.0)
WRONG_SHAPE, WRONG_LOAD = "tight: ttft 1 s, tpot 150 ms", 1.5
# (d): light's rate x capacity (above 1/2: light alone asks for more than its fair half),
# heavy's 10x that, arrivals over this many seconds (the count is rate x window).
BACKLOGGED_LIGHT_LOAD, BACKLOGGED_RATIO, BACKLOGGED_WINDOW_S = 0.75, 10, 120.0
# (e): a deadline (ms) on 70% of the requests (priority 0), 30% without one (priority 1); the
# shedding configurations compared (all sla), at these loads. Alone, a request takes about 1 to
# 3.3 s (32 to 96 outputs); in a full batch of 32 about three times that.
UNMEETABLE_DEADLINES_MS = (2000, 8000, 30000)
UNMEETABLE_LOADS = (1.5, 3.0)
SHEDDING = {"sla, no shedding": ["--scheduling-policy", "sla"],
            "sla --sla-drop-expired": ["--scheduling-policy", "sla", "--sla-drop-expired"],
            "sla --sla-drop-unmeetable": ["--scheduling-policy", "sla", "--sla-drop-unmeetable"]}
PARTS = ("overload", "tenants", "wrong-profile", "backlogged", "unmeetable")
# (d)'s policies: VTC alone, and as sla's fairness term (both tenants in one priority class).
BACKLOGGED_POLICIES = {"fcfs": ["--scheduling-policy", "fcfs"], "vtc": ["--scheduling-policy", "vtc"],
                       "sla (tenant fairness)": ["--scheduling-policy", "sla", "--sla-tenant-fairness"]}


@dataclass(frozen=True, slots=True)
class StepService:
    start_s: float
    backlogged: frozenset  # tenants with a request waiting or swapped when the step was scheduled
    service: dict  # tenant -> VTC's cost of what the step computes for it (prompt and output tokens)
    output_tokens: dict  # tenant -> tokens the step samples for it
    counters: Optional[dict]  # tenant -> vtc's counter when the step was scheduled (vtc only)


class TenantServiceLog:
    """The simulator's `on_step` observer: per step, each tenant's service as VTC counts it
    (`input_weight` per prompt token computed for the first time, `output_weight` per token
    sampled; the weights of the policy if it is vtc, else VTC's defaults), who is backlogged,
    and vtc's counters. It reads the scheduler and changes nothing. At `on_step` the step is
    scheduled but not applied, so the counters include every earlier step and none of this one."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        # The counters of vtc, or of sla with tenant fairness (its fairness term within a class).
        self.counters: Optional[VirtualTokenCounters] = getattr(scheduler.policy, "counters", None)
        cfg = self.counters.config if self.counters is not None else VTCConfig()
        self.input_weight, self.output_weight = cfg.input_weight, cfg.output_weight
        self.steps: list[StepService] = []

    def __call__(self, out: SchedulerOutput, now: float) -> None:
        sched = self.scheduler
        service: dict = {}
        outputs: dict = {}
        for rid, n in out.num_scheduled_tokens.items():
            r = sched.requests[rid]
            start, num_prompt = r.num_computed_tokens, r.num_prompt_tokens
            # Tokens below max_computed_tokens were computed before a preemption: not charged.
            fresh = max(0, min(start + n, num_prompt) - max(start, r.max_computed_tokens))
            sampled = 1 if start + n >= r.num_tokens else 0  # the simulator samples exactly these rows
            tenant = r.tenant
            service[tenant] = service.get(tenant, 0.0) + self.input_weight * fresh + self.output_weight * sampled
            outputs[tenant] = outputs.get(tenant, 0) + sampled
        backlogged = frozenset(r.tenant for queue in (sched.waiting, sched.swapped) for r in queue)
        counters = dict(self.counters.counters) if self.counters is not None else None
        self.steps.append(StepService(now, backlogged, service, outputs, counters))

    def step_bound(self) -> float:
        """U for this engine: the most one step can charge one tenant, the whole token budget as
        first-time prompt tokens plus a sampled token on every row (an upper bound: each decode
        row also takes a token of the budget)."""
        cfg = self.scheduler.config
        return self.input_weight * cfg.max_num_batched_tokens + self.output_weight * cfg.max_num_seqs

    def both_backlogged(self, a: str, b: str) -> dict:
        """Shares of service and output tokens over the steps scheduled while `a` and `b` were
        both backlogged, the time those steps took, the largest one-step charge seen and (vtc)
        the largest counter gap at those steps."""
        steps = self.steps
        window = [i for i, s in enumerate(steps) if a in s.backlogged and b in s.backlogged]
        service = {t: sum(steps[i].service.get(t, 0.0) for i in window) for t in (a, b)}
        outputs = {t: sum(steps[i].output_tokens.get(t, 0) for i in window) for t in (a, b)}
        seconds = sum(steps[i + 1].start_s - steps[i].start_s for i in window if i + 1 < len(steps))
        gaps = [abs(steps[i].counters.get(a, 0.0) - steps[i].counters.get(b, 0.0))
                for i in window if steps[i].counters is not None]
        return {"steps": len(window), "seconds": seconds,
                "first_s": steps[window[0]].start_s if window else None,
                "last_s": steps[window[-1]].start_s if window else None,
                "service": service, "output_tokens": outputs,
                "service_share": {t: v / (sum(service.values()) or 1.0) for t, v in service.items()},
                "output_share": {t: v / (sum(outputs.values()) or 1) for t, v in outputs.items()},
                "max_step_charge": max((v for s in steps for v in s.service.values()), default=0.0),
                "max_counter_gap": max(gaps) if gaps else None}


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def client_view(arrivals: Sequence[float], tenants: Sequence[Optional[str]], records: Sequence[RequestRecord],
                a: str = "heavy", b: str = "light", input_weight: float = 1.0, output_weight: float = 2.0) -> dict:
    """What a client can measure of (d), for the real engine (whose steps it does not see): a
    tenant counts as backlogged from a request's arrival until its first token (waiting, or in
    its prefill), and a request's prompt counts as served at its first token, its output tokens
    as its chunks arrive (a stream may put several tokens in one chunk: each chunk counts the
    request's mean tokens per chunk). Shares of VTC's cost and of output tokens over the time
    both tenants are backlogged so."""
    pending = {t: _merge([(t0, t0 + r.ttft) for t0, tn, r in zip(arrivals, tenants, records)
                          if tn == t and r.success]) for t in (a, b)}
    both: list[tuple[float, float]] = []
    i = j = 0
    pa, pb = pending[a], pending[b]
    while i < len(pa) and j < len(pb):
        lo, hi = max(pa[i][0], pb[j][0]), min(pa[i][1], pb[j][1])
        if lo < hi:
            both.append((lo, hi))
        if pa[i][1] < pb[j][1]:
            i += 1
        else:
            j += 1
    starts = [lo for lo, _ in both]

    def inside(t: float) -> bool:
        k = bisect.bisect_right(starts, t) - 1
        return k >= 0 and t < both[k][1]

    service = {a: 0.0, b: 0.0}
    outputs = {a: 0.0, b: 0.0}
    for t0, tenant, r in zip(arrivals, tenants, records):
        if tenant not in service or not r.success:
            continue
        first = t0 + r.ttft
        if inside(first):
            service[tenant] += input_weight * r.prompt_len
        per_chunk = r.output_tokens / (len(r.itl) + 1)
        for t in itertools.accumulate(r.itl, initial=first):
            if inside(t):
                service[tenant] += output_weight * per_chunk
                outputs[tenant] += per_chunk
    return {"seconds": float(sum(hi - lo for lo, hi in both)), "last_s": float(both[-1][1]) if both else None,
            "service_share": {t: v / (sum(service.values()) or 1.0) for t, v in service.items()},
            "output_share": {t: v / (sum(outputs.values()) or 1.0) for t, v in outputs.items()}}


def simulation(argv: list[str]) -> tuple[Workload, list[SLOClass], Simulator, StepCostModel]:
    """A `tokenweir simulate` command line built as the CLI builds it, not yet run: its workload,
    each request's --slo-mix class, the simulator (the shipped CPU profile) and its cost model."""
    ns = build_parser().parse_args(argv)
    args = engine_args_from(ns, SIM_SKIPPED_ENGINE_ARGS)
    cost_model = load_cost_model(None)
    bench.check_counts(ns)
    workload = bench.build_workload(ns, bench.load_tokenizer(ns.tokenizer))
    classes = bench.slo_classes_of(ns, len(workload.requests))
    return workload, classes, Simulator.from_engine_args(args, cost_model, timeseries_points=1), cost_model


def simulate_backlogged(policy: str, seed: int, capacity: float, window_s: float = BACKLOGGED_WINDOW_S) -> dict:
    """(d) in this process, with a TenantServiceLog on the simulator; `policy` a name of
    BACKLOGGED_POLICIES."""
    light_rate = BACKLOGGED_LIGHT_LOAD * capacity
    rate = light_rate * (BACKLOGGED_RATIO + 1)
    num = round(rate * window_s)
    argv = ["simulate", *WORKLOAD, "--num-prompts", str(num), *BACKLOGGED_POLICIES[policy],
            "--request-rate", f"{rate:.2f}", "--seed", str(seed),
            "--slo-mix", f"heavy:{BACKLOGGED_RATIO}:tenant=heavy", "light:1:tenant=light"]
    workload, classes, sim, cost_model = simulation(argv)  # the later --num-prompts wins, as on the command line
    log = TenantServiceLog(sim.scheduler)
    sim.on_step = log
    result = sim.run(sim_requests(workload, classes))
    report = class_report(result.records, classes, result.duration_s)
    window = log.both_backlogged("heavy", "light")
    return {"policy": policy, "seed": seed, "light_load": BACKLOGGED_LIGHT_LOAD, "ratio": BACKLOGGED_RATIO,
            "request_rate": round(rate, 2), "num_prompts": num,
            "last_arrival_s": float(max(workload.arrivals)), "duration": result.duration_s,
            "completed": sum(r.success for r in result.records), "num_preemptions": result.num_preemptions,
            "profile": profile_label(cost_model, None), "step_bound_u": log.step_bound(),
            "both_backlogged": window, "classes": report,
            "client_view": client_view([float(t) for t in workload.arrivals], [c.tenant for c in classes],
                                       result.records)}


class ShedWork:
    """The simulator's `on_step` observer: tokens each step schedules, per request, so that the
    compute spent on requests that end up shed can be summed after the run."""

    def __init__(self) -> None:
        self.tokens: dict[str, int] = {}

    def __call__(self, out: SchedulerOutput, now: float) -> None:
        tokens = self.tokens
        for rid, n in out.num_scheduled_tokens.items():
            tokens[rid] = tokens.get(rid, 0) + n


def simulate_unmeetable(name: str, deadline_ms: int, load: float, seed: int, capacity: float) -> dict:
    """(e) in this process: `name` a key of SHEDDING."""
    rate = load * capacity
    argv = ["simulate", *WORKLOAD, *SHEDDING[name], "--request-rate", f"{rate:.2f}", "--seed", str(seed),
            "--slo-mix", f"deadline:0.7:priority=0:deadline={deadline_ms}", "open:0.3:priority=1"]
    workload, classes, sim, cost_model = simulation(argv)
    work = ShedWork()
    sim.on_step = work
    requests = sim_requests(workload, classes)
    result = sim.run(requests)
    report = class_report(result.records, classes, result.duration_s)
    shed = {"expired": 0, "unmeetable": 0}
    shed_tokens = 0
    for sim_request, record in zip(requests, result.records):
        if record.error.startswith("deadline exceeded"):
            shed["expired"] += 1
        elif record.error.startswith("deadline cannot be met"):
            shed["unmeetable"] += 1
        else:
            continue
        shed_tokens += work.tokens.get(sim_request.request_id, 0)
    return {"config": name, "deadline_ms": deadline_ms, "load": load, "seed": seed, "request_rate": round(rate, 2),
            "duration": result.duration_s, "completed": sum(r.success for r in result.records),
            "num_preemptions": result.num_preemptions, "profile": profile_label(cost_model, None),
            "shed": shed, "tokens_computed": sum(work.tokens.values()), "tokens_computed_for_shed": shed_tokens,
            "classes": report}


def scaled_profile(scale: float, directory: Path) -> Path:
    """The shipped profile with every predicted time x `scale` (coefficients x scale, swap
    bandwidth / scale), written into `directory`."""
    shipped = load_cost_model(None)
    model = StepCostModel({k: v * scale for k, v in shipped.coefficients.items()},
                          shipped.swap_bytes_per_second / scale,
                          {**shipped.metadata, "source": f"the shipped profile, every time x{scale:g}"},
                          shipped.small_step_max_tokens, shipped.decode_knee)
    path = directory / f"shipped-x{scale:g}.json"
    path.write_text(json.dumps(model.to_dict()))
    return path


def simulate(flags: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "result.json"
        subprocess.run([sys.executable, "-m", "tokenweir.cli", "simulate", *WORKLOAD, *flags,
                        "--result-filename", str(path)], check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        return json.loads(path.read_text())


def summary(result: dict) -> dict:
    keep = {k: result[k] for k in ("request_rate", "seed", "duration", "completed", "failed", "num_preemptions",
                                   "profile")}
    keep["classes"] = result.get("slo_classes", {})
    return keep


def pct(values: list[float]) -> str:
    lo, hi, mean = min(values), max(values), sum(values) / len(values)
    return f"{mean:.1%} ({lo:.1%}-{hi:.1%})" if len(values) > 1 else f"{mean:.1%}"


def interactive_cells(runs: list[dict]) -> str:
    """The interactive class's SLO, TTFT and TPOT attainment and goodput over `runs`, as table
    cells (both overload tables have them)."""
    inter = [r["classes"]["interactive"] for r in runs]
    return (f"{pct([c['slo_attainment'] for c in inter])} | {pct([c['ttft_attainment'] for c in inter])} "
            f"| {pct([c['tpot_attainment'] for c in inter])} | {sum(c['goodput'] for c in inter) / len(inter):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loads", type=float, nargs="+", default=[1.5, 2.0, 3.0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES),
                        help="re-run only these overload rows; the others are kept from sla_sim.json")
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS,
                        help="run only these parts; the others are kept from sla_sim.json")
    ns = parser.parse_args()
    parts = set(ns.parts)
    rerun = set(ns.policies) if "overload" in parts else set()
    rerun_tenants = "tenants" in parts and set(ns.policies) == set(POLICIES)
    capacity = simulate(["--scheduling-policy", "fcfs", "--request-rate", "inf", "--seed", "1"])["request_throughput"]
    report: dict = {"simulated": True, "capacity_req_s": capacity, "overload": [], "tenants": [], "wrong_profile": [],
                    "backlogged": [], "unmeetable": []}
    if (rerun != set(POLICIES) or not rerun_tenants or "wrong-profile" not in parts or "backlogged" not in parts
            or "unmeetable" not in parts):
        previous = json.loads((OUT / "sla_sim.json").read_text())
        report["overload"] = [r for r in previous["overload"] if r["policy"] not in rerun]
        if not rerun_tenants:
            report["tenants"] = previous["tenants"]
        if "wrong-profile" not in parts:
            report["wrong_profile"] = previous.get("wrong_profile", [])
        if "backlogged" not in parts:
            report["backlogged"] = previous.get("backlogged", [])
        if "unmeetable" not in parts:
            report["unmeetable"] = previous.get("unmeetable", [])
    for shape in ns.shapes:
        for load in ns.loads:
            rate = f"{load * capacity:.2f}"
            for seed in ns.seeds:
                for name, flags in POLICIES.items():
                    if name not in rerun:
                        continue
                    result = simulate([*flags, "--request-rate", rate, "--seed", str(seed),
                                       "--slo-mix", *SHAPES[shape]])
                    report["overload"].append({"shape": shape, "policy": name, "load": load, **summary(result)})
    for seed in ns.seeds if rerun_tenants else ():
        for policy in ("fcfs", "vtc"):
            result = simulate(["--scheduling-policy", policy, "--request-rate", f"{1.5 * capacity:.2f}",
                               "--seed", str(seed), "--slo-mix", *TENANT_MIX])
            report["tenants"].append({"policy": policy, "load": 1.5, **summary(result)})
    if "wrong-profile" in parts:
        with tempfile.TemporaryDirectory() as tmp:
            for scale in WRONG_SCALES:
                profile = scaled_profile(scale, Path(tmp))
                for correction in (True, False):
                    for seed in ns.seeds:
                        result = simulate(["--scheduling-policy", "sla", "--sla-cost-profile", str(profile),
                                           f"--{'' if correction else 'no-'}sla-step-time-correction",
                                           "--request-rate", f"{WRONG_LOAD * capacity:.2f}", "--seed", str(seed),
                                           "--slo-mix", *SHAPES[WRONG_SHAPE]])
                        report["wrong_profile"].append({"shape": WRONG_SHAPE, "load": WRONG_LOAD, "guard_scale": scale,
                                                        "correction": correction, **summary(result)})
    for seed in ns.seeds if "backlogged" in parts else ():
        for policy in BACKLOGGED_POLICIES:
            report["backlogged"].append(simulate_backlogged(policy, seed, capacity))
    for deadline_ms in UNMEETABLE_DEADLINES_MS if "unmeetable" in parts else ():
        for load in UNMEETABLE_LOADS:
            for seed in ns.seeds:
                for name in SHEDDING:
                    report["unmeetable"].append(simulate_unmeetable(name, deadline_ms, load, seed, capacity))
    report["profile"] = report["overload"][0]["profile"]
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "sla_sim.json").write_text(json.dumps(report, indent=2))

    print(f"capacity {capacity:.2f} req/s; mean over seeds {ns.seeds} (min-max)")
    for shape in ns.shapes:
        print(f"\ninteractive {shape}\n")
        print("| load | policy | inter. SLO met | inter. TTFT met | inter. TPOT met | inter. goodput (req/s) "
              "| batch SLO met | batch finished | longest batch E2E (s) | preemptions |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for load in ns.loads:
            for name in POLICIES:
                runs = [r for r in report["overload"] if r["shape"] == shape and r["policy"] == name and r["load"] == load]
                batch = [r["classes"]["batch"] for r in runs]
                print(f"| x{load:g} | {name} | {interactive_cells(runs)} "
                      f"| {pct([c['slo_attainment'] for c in batch])} "
                      f"| {sum(c['completed'] for c in batch)}/{sum(c['requests'] for c in batch)} "
                      f"| {max(c['max_e2el_ms'] for c in batch) / 1e3:.0f} "
                      f"| {sum(r['num_preemptions'] for r in runs) / len(runs):.0f} |")
    print("\n| policy | seed | light share of tokens | heavy share | light p50 TTFT (s) | light longest E2E (s) "
          "| heavy p50 TTFT (s) |")
    print("|---|---|---|---|---|---|---|")
    for r in report["tenants"]:
        light, heavy = r["classes"]["light"], r["classes"]["heavy"]
        print(f"| {r['policy']} | {r['seed']} | {light['output_token_share']:.1%} | {heavy['output_token_share']:.1%} "
              f"| {light['median_ttft_ms'] / 1e3:.1f} | {light['max_e2el_ms'] / 1e3:.0f} "
              f"| {heavy['median_ttft_ms'] / 1e3:.1f} |")
    heavy_load = BACKLOGGED_LIGHT_LOAD * BACKLOGGED_RATIO
    print(f"\nboth tenants backlogged: light x{BACKLOGGED_LIGHT_LOAD:g}, heavy x{heavy_load:g} "
          f"of capacity, arrivals over {BACKLOGGED_WINDOW_S:g} s; shares over the steps scheduled while both are\n")
    print("| policy | seed | requests (light) | both backlogged (s of run) | light share of service "
          "| light share of output tokens | largest step charge | largest counter gap | bound 2U "
          "| light p50 TTFT (s) | heavy p50 TTFT (s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in report["backlogged"]:
        w, light, heavy = r["both_backlogged"], r["classes"]["light"], r["classes"]["heavy"]
        gap = "-" if w["max_counter_gap"] is None else f"{w['max_counter_gap']:.0f}"
        print(f"| {r['policy']} | {r['seed']} | {r['num_prompts']} ({light['requests']}) "
              f"| {w['seconds']:.0f} of {r['duration']:.0f} | {w['service_share']['light']:.1%} "
              f"| {w['output_share']['light']:.1%} | {w['max_step_charge']:.0f} | {gap} | {2 * r['step_bound_u']:.0f} "
              f"| {light['median_ttft_ms'] / 1e3:.1f} | {heavy['median_ttft_ms'] / 1e3:.1f} |")
    print("\n70% of the requests with a deadline (priority 0), 30% without (priority 1), sla; mean over seeds "
          "(min-max)\n")
    print("| deadline | load | shedding | deadline met (of those with one) | deadline goodput (req/s) "
          "| no-deadline goodput (req/s) | shed: expired / unmeetable | tokens computed for shed requests |")
    print("|---|---|---|---|---|---|---|---|")
    for deadline_ms in UNMEETABLE_DEADLINES_MS:
        for load in UNMEETABLE_LOADS:
            for name in SHEDDING:
                runs = [r for r in report["unmeetable"]
                        if r["config"] == name and r["deadline_ms"] == deadline_ms and r["load"] == load]
                if not runs:
                    continue
                with_deadline = [r["classes"]["deadline"] for r in runs]
                without = [r["classes"]["open"] for r in runs]
                expired = sum(r["shed"]["expired"] for r in runs) / len(runs)
                unmeetable = sum(r["shed"]["unmeetable"] for r in runs) / len(runs)
                wasted = sum(r["tokens_computed_for_shed"] for r in runs) / sum(r["tokens_computed"] for r in runs)
                print(f"| {deadline_ms / 1e3:g} s | x{load:g} | {name} "
                      f"| {pct([c['deadline_attainment'] for c in with_deadline])} "
                      f"| {sum(c['goodput'] for c in with_deadline) / len(runs):.3f} "
                      f"| {sum(c['goodput'] for c in without) / len(runs):.3f} "
                      f"| {expired:.0f} / {unmeetable:.0f} | {wasted:.1%} |")
    print(f"\nsla's SLO guard given a wrong profile: interactive {WRONG_SHAPE}, x{WRONG_LOAD:g} "
          "(the simulated machine: the shipped profile)\n")
    print("| guard profile | step-time correction | inter. SLO met | inter. TTFT met | inter. TPOT met "
          "| inter. goodput (req/s) | batch SLO met | batch goodput (req/s) | preemptions |")
    print("|---|---|---|---|---|---|---|---|---|")
    true_rows = [r for r in report["overload"]
                 if r["shape"] == WRONG_SHAPE and r["policy"] == "sla" and r["load"] == WRONG_LOAD]
    rows = [("shipped (the true one)", "on", true_rows)]
    for scale in WRONG_SCALES:
        for correction in (True, False):
            runs = [r for r in report["wrong_profile"] if r["guard_scale"] == scale and r["correction"] == correction]
            rows.append((f"shipped x{scale:g}", "on" if correction else "off", runs))
    for label, correction_label, runs in rows:
        if not runs:
            continue
        batch = [r["classes"]["batch"] for r in runs]
        print(f"| {label} | {correction_label} | {interactive_cells(runs)} | {pct([c['slo_attainment'] for c in batch])} "
              f"| {sum(c['goodput'] for c in batch) / len(batch):.3f} "
              f"| {sum(r['num_preemptions'] for r in runs) / len(runs):.0f} |")


if __name__ == "__main__":
    main()

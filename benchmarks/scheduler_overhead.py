"""CPU cost of one scheduler step: schedule() + update_from_output(), no model.

Scenarios: 256 running decodes with 10,000 requests waiting behind the max_num_seqs cap, and
1,024 running decodes. Also the cost of one prefix-cache block key (BLAKE2b over the canonical
encoding) beside the 64-bit tuple hash it replaced. Writes docs/benchmarks/scheduler.md (+ .json)
with the per-step time, and the top of a cProfile of the same loop for fcfs and for the slowest
case at 256 running (every case's profile is in the JSON).

    .venv/bin/python benchmarks/scheduler_overhead.py [--steps 2000] [--repeats 3]

With --repeats N every case runs N times, the cases interleaved (round 1 of all, then round 2,
...): the machine is shared, and a burst of another job lands on one round of a case, not on
all of its rounds, so the median over rounds is the figure and the range shows the noise.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import platform
import pstats
import statistics
import time
from pathlib import Path
from typing import Callable, Optional

from tokenweir.config import CacheConfig, SchedulerConfig
from tokenweir.core.batch_slo import SLOBatchConfig
from tokenweir.core.block_hash import BlockHasher
from tokenweir.core.composition import CompositionConfig
from tokenweir.core.policies import SLAConfig
from tokenweir.core.scheduler import Scheduler
from tokenweir.machine import cpu_name
from tokenweir.request import Request, SamplingParams, SchedulingHints

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"


# Step length of the virtual clock (the policies' scores move with time, so it must advance).
STEP_S = 0.02


def mixed_hints(i: int) -> SchedulingHints:
    """The SLO mix of the policy cases: 30% interactive (priority 0, tight SLOs), 70% batch
    (priority 1, loose), 8 tenants, deadlines on a tenth of the requests."""
    interactive = i % 10 < 3
    return SchedulingHints(priority=0 if interactive else 1, tenant=f"tenant-{i % 8}",
                           ttft_slo=1.0 if interactive else 30.0, tpot_slo=0.1 if interactive else 1.0,
                           deadline=600.0 if i % 10 == 9 else None)


def all_deadline_hints(i: int) -> SchedulingHints:
    """mixed_hints with a deadline on every request (600 s: none is shed while measured), for
    the cost of sla's drop_unmeetable bookkeeping: every arrival is looked at."""
    h = mixed_hints(i)
    return SchedulingHints(priority=h.priority, tenant=h.tenant, ttft_slo=h.ttft_slo, tpot_slo=h.tpot_slo,
                           deadline=600.0)


def batch_backlog_hints(i: int) -> SchedulingHints:
    """Overload as it looks under `sla`: the running requests mix both classes (the first 256
    of the burst), the backlog is batch only (interactive arrivals are admitted at once), so the
    queue's head is less important than requests running: sla's SLO guard has work to do."""
    h = mixed_hints(i)
    return h if i < 256 else SchedulingHints(priority=1, tenant=h.tenant, ttft_slo=30.0, tpot_slo=1.0)


# Concurrent partial prefills on (core/prefill_limits.py): prompts of 128 tokens are long.
PARTIAL_PREFILLS = dict(max_num_partial_prefills=4, max_long_partial_prefills=1, long_prefill_token_threshold=64)
# The slo case: a target loose enough for every running request (the cap stays at 256), so
# the step is the fcfs one plus the controller's feedback and adjustments.
SLO_BATCH = dict(batch_controller="slo", batch_control_config=SLOBatchConfig(target_tpot_ms=60_000.0))
# Holding TPOT: a pass over the running requests' due tokens before every step.
SLO_BATCH_TPOT = dict(batch_controller="slo", batch_control_config=SLOBatchConfig(target_tpot_ms=60_000.0, hold="tpot"))


def build(num_running: int, num_waiting: int, prompt_len: int = 128, policy: str = "fcfs",
          policy_config=None, options: Optional[dict] = None,
          hints_of: Callable[[int], SchedulingHints] = mixed_hints) -> Scheduler:
    block_size = 16
    blocks_per_req = (prompt_len + 4096) // block_size + 1  # room to decode for a long time
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=max(2048, num_running), max_num_seqs=num_running,
                        policy=policy, policy_config=policy_config, **(options or {})),
        CacheConfig(block_size=block_size, num_blocks=num_running * blocks_per_req))
    params = SamplingParams(max_tokens=None, ignore_eos=True)
    for i in range(num_running + num_waiting):
        prompt = [(i * 7 + j) % 50000 for j in range(prompt_len)]
        hints = hints_of(i) if policy != "fcfs" else SchedulingHints()
        # Arrivals 1 ms apart, all before the clock starts: the queue is one burst deep.
        sched.add_request(Request(f"req-{i}", prompt, params, arrival_time=i * 1e-3, eos_token_id=2,
                                  hints=hints))
    # Prefill everything that can run, until all running requests decode one token per step.
    now = (num_running + num_waiting) * 1e-3
    while True:
        out = sched.schedule(now)
        sched.update_from_output(out, {rid: [5] for rid in out.num_scheduled_tokens}, now)
        now += STEP_S
        if len(out.num_scheduled_tokens) == num_running and out.total_num_scheduled_tokens == num_running:
            sched.bench_now = now  # type: ignore[attr-defined]
            return sched


def collect_earlier_garbage() -> None:
    """Collect what earlier cases dropped before a case is timed. A dropped scheduler is cyclic
    garbage (the free-block queue is doubly linked; sla's queue holds its policy's bound
    methods), 100,000+ objects: left alone, the next case's steps would pay for the full
    collection that frees it. The collections a case's own steps cause are still timed: they
    are part of its cost."""
    gc.collect()


class CollectorTime:
    """CPU seconds CPython's cyclic collector runs inside the block (gc.callbacks): the part of
    a case's steps that is collections its own allocations caused."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._start = 0.0

    def __enter__(self) -> "CollectorTime":
        gc.callbacks.append(self._on_collection)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on_collection)

    def _on_collection(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.process_time()
        else:
            self.seconds += time.process_time() - self._start


def run_steps(sched: Scheduler, steps: int) -> None:
    now = sched.bench_now  # type: ignore[attr-defined]
    for _ in range(steps):
        out = sched.schedule(now)
        sched.update_from_output(out, {rid: [7] for rid in out.num_scheduled_tokens}, now)
        now += STEP_S
    sched.bench_now = now  # type: ignore[attr-defined]


def policy_config_label(config) -> str:
    return ", ".join(f"{k}={v}" for k, v in vars(config).items() if v != getattr(type(config)(), k))


def settle(sched: Scheduler, max_steps: int = 5000) -> None:
    """Run until a step admits and preempts nothing (the policy cases start with interactive
    requests preempting batch ones until those are protected or gone)."""
    for _ in range(max_steps):
        before = sched.num_preemptions
        now = sched.bench_now  # type: ignore[attr-defined]
        out = sched.schedule(now)
        sched.update_from_output(out, {rid: [7] for rid in out.num_scheduled_tokens}, now)
        sched.bench_now = now + STEP_S  # type: ignore[attr-defined]
        if not out.scheduled_new_reqs and sched.num_preemptions == before:
            return


def build_long_slot_taken(num_running: int, num_waiting: int, steps: int) -> Scheduler:
    """The partial-prefill limits' worst case: `num_running` decodes and one long prefill (it
    outlasts the measurement) hold the only long slot, sequence slots are free, and every
    waiting prompt is long, so admission looks past as many as it may in every step."""
    block_size, budget = 16, 2 * num_running + 64  # room left after the hog's capped chunk
    hog_len = (steps * 2 + 200) * (budget - num_running)  # the top-up gives it the leftover budget
    decode_blocks = (steps * 2 + 400) // block_size + 2
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=num_running + 64, **PARTIAL_PREFILLS),
        CacheConfig(block_size=block_size, num_blocks=num_running * decode_blocks + hog_len // block_size + 64))
    params = SamplingParams(max_tokens=None, ignore_eos=True)
    for i in range(num_running):  # short: 4 admitted per step
        sched.add_request(Request(f"run-{i}", [(i * 7 + j) % 50000 for j in range(32)], params,
                                  arrival_time=i * 1e-3, eos_token_id=2))
    now = num_running * 1e-3
    while len(sched.running) < num_running or any(r.num_computed_tokens < 32 for r in sched.running):
        out = sched.schedule(now)
        sched.update_from_output(out, {rid: [5] for rid in out.num_scheduled_tokens}, now)
        now += STEP_S
    sched.add_request(Request("hog", [j % 50000 for j in range(hog_len)], params, arrival_time=now, eos_token_id=2))
    for i in range(num_waiting):
        sched.add_request(Request(f"long-{i}", [(i * 11 + j + 7) % 50000 for j in range(128)], params,
                                  arrival_time=now + (i + 1) * 1e-6, eos_token_id=2))
    sched.bench_now = now  # type: ignore[attr-defined]
    return sched


def measure(num_running: int, num_waiting: int, steps: int, policy: str = "fcfs", policy_config=None,
            options: Optional[dict] = None, long_slot_taken: bool = False,
            hints_of: Callable[[int], SchedulingHints] = mixed_hints) -> dict:
    if long_slot_taken:
        sched = build_long_slot_taken(num_running, num_waiting, steps)
    else:
        sched = build(num_running, num_waiting, policy=policy, policy_config=policy_config, options=options,
                      hints_of=hints_of)
    if options is not None and "batch_controller" in options:
        assert len(sched.running) == num_running, "the slo cap must hold every running request here"
    settle(sched)
    run_steps(sched, 50)  # warm up
    collect_earlier_garbage()
    with CollectorTime() as collector:
        start = time.process_time()
        run_steps(sched, steps)
        per_step_ms = (time.process_time() - start) / steps * 1e3
    top = profile_top(lambda: run_steps(sched, min(steps, 500)))
    label = policy if policy_config is None else f"{policy} ({policy_config_label(policy_config)})"
    if hints_of is batch_backlog_hints:
        label += ", batch-only backlog"
    elif hints_of is all_deadline_hints:
        label += ", a deadline on every request"
    options = dict(options or {})
    composition = options.pop("composition", None)
    label += options_label(options, long_slot_taken)
    if composition is not None:
        label += f", {composition.admission_order} order"
    return {"policy": label,
            "num_running": num_running, "num_waiting": num_waiting, "steps": steps,
            "cpu_ms_per_step": round(per_step_ms, 4),
            "collector_ms_per_step": round(collector.seconds / steps * 1e3, 4),
            "us_per_running_request": round(per_step_ms * 1e3 / num_running, 3), "profile_top": top}


def options_label(options: dict, long_slot_taken: bool = False) -> str:
    """What a case's scheduler options (SLO_BATCH, PARTIAL_PREFILLS) add to its label."""
    label = ", --batch-controller slo" if "batch_controller" in options else ""
    if "batch_control_config" in options and options["batch_control_config"].hold != "itl":
        label += f" --batch-control-hold {options['batch_control_config'].hold}"
    if set(options) & set(PARTIAL_PREFILLS) or long_slot_taken:
        label += " + partial prefills 4/1" + (", long slot taken, all waiting long" if long_slot_taken else "")
    return label


def profile_top(run) -> str:
    """The top of a cProfile of `run()` by own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    run()
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(8)
    top = "\n".join(line for line in text.getvalue().splitlines() if line.strip())
    return top[top.index("ncalls"):] if "ncalls" in top else top


CHURN_PREFIXES = 8  # system prompts of the churn case
CHURN_PREFIX_LEN, CHURN_SUFFIX_LEN = 128, 32


def churn_request(i: int, hints: SchedulingHints, arrival_time: float) -> Request:
    """One of CHURN_PREFIXES shared prefixes, a unique suffix, 32 to 95 output tokens."""
    p = i % CHURN_PREFIXES
    prompt = [p * 1000 + j for j in range(CHURN_PREFIX_LEN)] + [(i * 7 + j) % 50000 + 10_000
                                                              for j in range(CHURN_SUFFIX_LEN)]
    return Request(f"churn-{i}", prompt, SamplingParams(max_tokens=32 + (i * 37) % 64, ignore_eos=True),
                   arrival_time=arrival_time, eos_token_id=2, hints=hints)


def measure_churn(num_running: int, num_waiting: int, steps: int,
                  composition: CompositionConfig = CompositionConfig(), policy: str = "fcfs",
                  policy_config=None, hints_of: Callable[[int], SchedulingHints] = mixed_hints,
                  options: Optional[dict] = None, int8_kv: bool = False) -> dict:
    """256 running and 10,000 waiting, requests finishing and admitted every step (each one
    replaced by a new arrival outside the timed calls): the admission order chooses every step.
    `options`: more SchedulerConfig fields (SLO_BATCH, PARTIAL_PREFILLS). `int8_kv`: int8 K/V for
    priority >= 1, and under fcfs every other request has priority 1 (bf16 blocks of 16 at
    head_dim 64: 28 int8 tokens per block, the engine's figure for the default model).
    Under a policy other than fcfs every request has the policy cases' hints (mixed_hints), and
    the replacements arrive at the step's time, so their SLOs fall due while they wait."""
    block_size = 16
    per_req = (CHURN_PREFIX_LEN + CHURN_SUFFIX_LEN + 96) // block_size + 1
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=num_running, composition=composition,
                        policy=policy, policy_config=policy_config, **(options or {})),
        CacheConfig(block_size=block_size, num_blocks=num_running * per_req + 8 * CHURN_PREFIXES,
                    **(dict(int8_kv_min_priority=1, int8_block_size=28) if int8_kv else {})))
    counter = iter(range(10**9))

    def new_request(arrival_time: Optional[float]) -> Request:
        i = next(counter)
        hints = (hints_of(i) if policy != "fcfs" else
                 SchedulingHints(priority=i % 2) if int8_kv else SchedulingHints())
        return churn_request(i, hints, i * 1e-3 if arrival_time is None else arrival_time)

    for _ in range(num_running + num_waiting):
        sched.add_request(new_request(None))
    now = 20.0

    def run(n: int) -> float:
        """n steps; the CPU seconds of the scheduler calls among them."""
        nonlocal now
        clock = 0.0
        for _ in range(n):
            start = time.process_time()
            out = sched.schedule(now)
            updates = sched.update_from_output(out, {rid: [7] for rid in out.num_scheduled_tokens}, now)
            clock += time.process_time() - start
            for _ in range(sum(1 for u in updates if u.request.is_finished)):
                sched.add_request(new_request(None if policy == "fcfs" else now))
            now += STEP_S
        return clock

    run(450)  # through the first admissions into steady churn, and warm
    collect_earlier_garbage()
    with CollectorTime() as collector:
        per_step_ms = run(steps) / steps * 1e3
    label = policy if policy_config is None else f"{policy} ({policy_config_label(policy_config)})"
    if hints_of is all_deadline_hints:
        label += ", a deadline on every request"
    label += options_label(options or {}) + (", int8 K/V for priority >= 1 (half)" if int8_kv else "")
    return {"policy": f"{label}, churn (8 shared prefixes), {composition.admission_order} order",
            "num_running": num_running, "num_waiting": num_waiting, "steps": steps,
            "cpu_ms_per_step": round(per_step_ms, 4),
            "collector_ms_per_step": round(collector.seconds / steps * 1e3, 4),
            "us_per_running_request": round(per_step_ms * 1e3 / num_running, 3),
            "profile_top": profile_top(lambda: run(min(steps, 500)))}


def measure_hashing(num_blocks: int = 100_000, block_size: int = 16) -> dict:
    """CPU time per block key: the keyed BLAKE2b of core/block_hash.py vs Python's tuple hash."""
    blocks = [[(i * 31 + j) % 50000 for j in range(block_size)] for i in range(num_blocks)]
    hasher = BlockHasher(b"deployment-key")
    start = time.process_time()
    parent = hasher.root()
    for tokens in blocks:
        parent = hasher.hash_block(parent, tokens)
    blake_us = (time.process_time() - start) / num_blocks * 1e6
    start = time.process_time()
    old = 0
    for tokens in blocks:
        old = hash((old, tuple(tokens)))
    tuple_us = (time.process_time() - start) / num_blocks * 1e6
    return {"block_size": block_size, "blocks": num_blocks, "blake2b_us_per_block": round(blake_us, 3),
            "tuple_hash_us_per_block": round(tuple_us, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every case, interleaved")
    parser.add_argument("--cases", nargs="+", default=None, help="a subset of the cases, by name (printed only)")
    args = parser.parse_args()
    cases = {"fcfs": lambda: measure(256, 10_000, args.steps), "fcfs-1024": lambda: measure(1024, 0, args.steps // 2),
             "sla": lambda: measure(256, 10_000, args.steps, "sla"),
             "sla-batch-backlog": lambda: measure(256, 10_000, args.steps, "sla", hints_of=batch_backlog_hints),
             "sla-tenants": lambda: measure(256, 10_000, args.steps, "sla", SLAConfig(tenant_fairness=True)),
             "vtc": lambda: measure(256, 10_000, args.steps, "vtc"),
             "slo": lambda: measure(256, 10_000, args.steps, options=SLO_BATCH),
             "slo-tpot": lambda: measure(256, 10_000, args.steps, options=SLO_BATCH_TPOT),
             "partial-prefills": lambda: measure(256, 10_000, args.steps, options=PARTIAL_PREFILLS),
             "partial-prefills-passing": lambda: measure(256, 10_000, args.steps, long_slot_taken=True),
             "cache-aware": lambda: measure(256, 10_000, args.steps,
                                            options=dict(composition=CompositionConfig("cache-aware"))),
             "priority-cache-aware": lambda: measure(256, 10_000, args.steps, "priority",
                                                     options=dict(composition=CompositionConfig("cache-aware"))),
             **{f"churn-{order}": (lambda order=order: measure_churn(256, 10_000, args.steps, CompositionConfig(order)))
                for order in ("policy", "cache-aware", "length-aware", "sampling-grouped", "cache-aware,sampling-grouped")},
             "churn-sla": lambda: measure_churn(256, 10_000, args.steps, policy="sla"),
             "churn-sla-tenants": lambda: measure_churn(256, 10_000, args.steps, policy="sla",
                                                        policy_config=SLAConfig(tenant_fairness=True)),
             "churn-vtc": lambda: measure_churn(256, 10_000, args.steps, policy="vtc"),
             "sla-drop-unmeetable": lambda: measure(256, 10_000, args.steps, "sla", SLAConfig(drop_unmeetable=True),
                                                    hints_of=all_deadline_hints),
             "churn-sla-drop-unmeetable": lambda: measure_churn(256, 10_000, args.steps, policy="sla",
                                                                policy_config=SLAConfig(drop_unmeetable=True),
                                                                hints_of=all_deadline_hints),
             "churn-slo": lambda: measure_churn(256, 10_000, args.steps, options=SLO_BATCH),
             "churn-slo-tpot": lambda: measure_churn(256, 10_000, args.steps, options=SLO_BATCH_TPOT),
             "churn-partial-prefills": lambda: measure_churn(256, 10_000, args.steps, options=PARTIAL_PREFILLS),
             "churn-int8-kv": lambda: measure_churn(256, 10_000, args.steps, int8_kv=True)}
    unknown = [name for name in args.cases or () if name not in cases]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}; the cases: {', '.join(cases)}")
    if args.cases:  # a subset: printed only, the docs stay as the last full run wrote them
        for name in args.cases:
            r = cases[name]()
            print(f"{r['policy']}: {r['num_running']} running + {r['num_waiting']} waiting: "
                  f"{r['cpu_ms_per_step']} ms/step\n{r['profile_top']}")
        return
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    rounds = [[case() for case in cases.values()] for _ in range(args.repeats)]
    results = []
    for runs in zip(*rounds):
        times = [r["cpu_ms_per_step"] for r in runs]
        median = statistics.median(times)
        n = runs[0]["num_running"]
        results.append({**runs[0], "cpu_ms_per_step": round(median, 4), "cpu_ms_per_step_rounds": times,
                        "collector_ms_per_step": statistics.median(r["collector_ms_per_step"] for r in runs),
                        "us_per_running_request": round(median * 1e3 / n, 3)})
    hashing = measure_hashing()
    machine = f"{cpu_name()}, {platform.python_implementation()} {platform.python_version()}"
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "scheduler.json").write_text(json.dumps({"machine": machine, "results": results, "hashing": hashing}, indent=2))
    lines = ["# Scheduler overhead", "",
             "CPU time (`time.process_time`) of one `schedule()` + `update_from_output()` in steady "
             "decode, no model; every running request decodes one token per step.", "",
             f"Command: `.venv/bin/python benchmarks/scheduler_overhead.py --steps {args.steps} --repeats {args.repeats}`  ",
             f"Machine: {machine}, 2 shared cores (shared with other jobs: runs minutes apart differ "
             "by up to 40% per case, so compare cases only within one run, and code only in paired runs).  ",
             f"Each case ran {args.repeats} times, the cases interleaved (round 1 of every case, then "
             "round 2, ...); the table gives the median over rounds and every round's figure.", "",
             "| policy | running | waiting | CPU ms / step (median) | rounds | of it, collector (median) "
             "| us / running request |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        rounds_text = " / ".join(f"{t:.2f}" for t in r["cpu_ms_per_step_rounds"])
        lines.append(f"| {r['policy']} | {r['num_running']} | {r['num_waiting']} | {r['cpu_ms_per_step']:.3f} "
                     f"| {rounds_text} | {r['collector_ms_per_step']:.3f} | {r['us_per_running_request']} |")
    over = [r["policy"] for r in results if r["num_running"] == 256 and r["cpu_ms_per_step"] > 1.0]
    collected = [r["policy"] for r in results if r["collector_ms_per_step"] > 0]
    lines += ["", "Target: <= 1 ms per step at 256 running + 10k waiting, for every policy. Cases over it "
              f"(median) in this run: {'; '.join(over) if over else 'none'}. The policy "
              "cases (`sla`, `vtc`) give every request SchedulingHints: 30% interactive (priority 0, "
              "TTFT 1 s, TPOT 100 ms), 70% batch (priority 1, TTFT 30 s, TPOT 1 s), 8 tenants, a "
              "deadline on every tenth; the virtual clock advances 20 ms per step, and measuring "
              "starts once interactive requests have stopped preempting batch ones.", "",
              f"Prefix-cache block keys ({hashing['block_size']}-token blocks, {hashing['blocks']:,} "
              f"chained): keyed BLAKE2b {hashing['blake2b_us_per_block']} us "
              f"per block vs {hashing['tuple_hash_us_per_block']} us for the 64-bit tuple hash it "
              "replaced (forgeable: see docs/architecture.md, prefix caching). A key is computed once "
              "per full block of a request (at admission lookup or when the block fills), so in steady "
              "decode it costs one key per request every block_size steps.", "",
              "Where the time goes: the waiting queue costs nothing per step once `max_num_seqs` is "
              "reached (the admission loop stops at its head), so the cost is linear in the number of "
              f"running requests, about {results[0]['us_per_running_request']:.1f} us each (fcfs): "
              "`update_from_output` (append the token, stop "
              "checks, publish a block every `block_size` tokens) is more than half, the running "
              "loop of `schedule` (a decode whose last block has room is answered by "
              "`allocate_slots` with one comparison, without the capping and preemption helpers) "
              "and building the `SchedulerOutput` records the rest. Per-request cost grows at 1,024 "
              "running (cache misses on the larger working set). The churn cases add about 4 "
              "admissions and 4 finishes per step: each admission hashes its prompt's blocks "
              "(BLAKE2b, above) and copies its tokens into `NewRequestData`.", "",
              "The policy cases add to that: the feedback of every step (`StepServed`, one column per "
              "field, and for `vtc` and tenant fairness the counters charged per tenant), and for "
              "`sla` the admission attempt of the queue's head every step: the threshold walk that "
              "finds it (in steady decode a few heap entries per class; with churn, some 4 pops "
              "per step, 5-20 entries scored per pop, more while a late backlog's two ends score "
              "alike: it walks by a key in which aging cancels against the due time, by due time "
              "from both ends of the pending and late ranges, and by key, with the late range "
              "bounded piece by piece; classes that cannot beat an earlier one are skipped) and the check that it can preempt nobody, from a per-class floor "
              "of the running requests' keys without scanning them. `priority` looks for a victim "
              "among the running requests whenever its queue's head tries to get in (every step "
              "here), one key per running request (`priority_key`, an attrgetter). Objects "
              "allocated per request per step and kept to the step's end (a feedback record, a copy "
              "of the sampled tokens, an empty block list) used to push CPython's collector into "
              "passes over every object of the 10,000 waiting requests, 0.1-0.3 ms per step in the "
              "policy cases; the step allocates none of them now.", "",
              "The collector column is the CPU time of CPython's cyclic collector inside the timed "
              "steps (gc.callbacks; what earlier cases dropped is collected before a case is timed). "
              "A step that frees about as many tracked objects as it allocates never reaches the "
              "collector's threshold; one that keeps some (new heap entries, entries of requests "
              "that left, freed in bulk when a heap is compacted: the collector's count does not go "
              "below zero, so frees in bulk do not cancel allocations spread over steps) runs young "
              "collections every few tens of steps and now and then a full one, which walks every "
              "object of the process (here the 10,000 waiting requests; in a server also the "
              "model's): one such collection is a pause of tens of milliseconds or more inside one step. "
              f"Cases with collections in this run: {'; '.join(collected) if collected else 'none'}.", "",
              "`--batch-controller slo` adds to the fcfs step, unless every request decoded and none "
              "finished, one sum over the running requests' computed tokens (the `StepObservation` it "
              "learns from), a prediction of that step and one of each prompt chunk it admits, and once "
              "per adjustment interval (1 s, 50 steps of this clock) a sort of the window's step periods "
              "and two binary searches over the cost model. Holding TPOT it also copies the running list "
              "each step, and passes over the running requests' due times only when a chunk does not fit "
              "under the bound the last step's observation gives (in these cases it fits at every step "
              "after the first).",
              "", "Paired before/after runs of earlier optimisations: `scheduler_history.md`.", ""]
    at_256 = [r for r in results if r["num_running"] == 256]
    slowest = max(at_256[1:], key=lambda r: r["cpu_ms_per_step"])
    for r in (at_256[0], slowest):
        lines += [f"## Profile: {r['policy']}, {r['num_running']} running, {r['num_waiting']} waiting "
                  f"(top by own time{', the slowest case of this run' if r is slowest else ''})",
                  "", "```", r["profile_top"], "```", ""]
    (OUT / "scheduler.md").write_text("\n".join(lines))
    for r in results:
        print(f"{r['policy']}: {r['num_running']} running + {r['num_waiting']} waiting: "
              f"{r['cpu_ms_per_step']} ms/step")


if __name__ == "__main__":
    main()

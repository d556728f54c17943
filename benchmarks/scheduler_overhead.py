"""CPU cost of one scheduler step: schedule() + update_from_output(), no model.

Scenarios: 256 running decodes with 10,000 requests waiting behind the max_num_seqs cap, and
1,024 running decodes. Also the cost of one prefix-cache block key (BLAKE2b over the canonical
encoding) beside the 64-bit tuple hash it replaced. Writes docs/benchmarks/scheduler.md (+ .json)
with the per-step time and the top of a cProfile of the same loop.

    .venv/bin/python benchmarks/scheduler_overhead.py [--steps 2000]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import time
from pathlib import Path

from tokenweir.config import CacheConfig, SchedulerConfig
from tokenweir.core.block_hash import BlockHasher
from tokenweir.core.composition import CompositionConfig
from tokenweir.core.policies import SLAConfig
from tokenweir.core.scheduler import Scheduler
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


def build(num_running: int, num_waiting: int, prompt_len: int = 128, policy: str = "fcfs",
          policy_config=None, composition: CompositionConfig = CompositionConfig()) -> Scheduler:
    block_size = 16
    blocks_per_req = (prompt_len + 4096) // block_size + 1  # room to decode for a long time
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=max(2048, num_running), max_num_seqs=num_running,
                        policy=policy, policy_config=policy_config, composition=composition),
        CacheConfig(block_size=block_size, num_blocks=num_running * blocks_per_req))
    params = SamplingParams(max_tokens=None, ignore_eos=True)
    for i in range(num_running + num_waiting):
        prompt = [(i * 7 + j) % 50000 for j in range(prompt_len)]
        hints = mixed_hints(i) if policy != "fcfs" else SchedulingHints()
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


def measure(num_running: int, num_waiting: int, steps: int, policy: str = "fcfs", policy_config=None,
            composition: CompositionConfig = CompositionConfig()) -> dict:
    sched = build(num_running, num_waiting, policy=policy, policy_config=policy_config, composition=composition)
    settle(sched)
    return timed(sched, steps, cpu_seconds_of(run_steps), label_of(policy, policy_config, composition),
                 num_running, num_waiting)


def cpu_seconds_of(run):
    """`run(sched, steps)` made to return the CPU seconds it took."""
    def timed_run(sched: Scheduler, steps: int) -> float:
        start = time.process_time()
        run(sched, steps)
        return time.process_time() - start
    return timed_run


def label_of(policy: str, policy_config, composition: CompositionConfig) -> str:
    label = policy if policy_config is None else f"{policy} ({policy_config_label(policy_config)})"
    return label if composition.admission_order == "policy" else f"{label}, {composition.admission_order} order"


def timed(sched: Scheduler, steps: int, run, label: str, num_running: int, num_waiting: int) -> dict:
    """`run(sched, steps)` returns the CPU seconds of the scheduler calls it made."""
    run(sched, 50)  # warm up
    per_step_ms = run(sched, steps) / steps * 1e3
    profiler = cProfile.Profile()
    profiler.enable()
    run(sched, min(steps, 500))
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(8)
    top = "\n".join(line for line in text.getvalue().splitlines() if line.strip())
    top = top[top.index("ncalls"):] if "ncalls" in top else top
    return {"policy": label, "num_running": num_running, "num_waiting": num_waiting, "steps": steps,
            "cpu_ms_per_step": round(per_step_ms, 4),
            "us_per_running_request": round(per_step_ms * 1e3 / num_running, 3), "profile_top": top}


CHURN_PREFIXES = 8  # system prompts of the churn case
CHURN_PREFIX_LEN, CHURN_SUFFIX_LEN = 128, 32


def churn_request(i: int) -> Request:
    """One of CHURN_PREFIXES shared prefixes, a unique suffix, 32 to 95 output tokens."""
    p = i % CHURN_PREFIXES
    prompt = [p * 1000 + j for j in range(CHURN_PREFIX_LEN)] + [(i * 7 + j) % 50000 + 10_000
                                                              for j in range(CHURN_SUFFIX_LEN)]
    return Request(f"churn-{i}", prompt, SamplingParams(max_tokens=32 + (i * 37) % 64, ignore_eos=True),
                   arrival_time=i * 1e-3, eos_token_id=2)


def measure_churn(num_running: int, num_waiting: int, steps: int, composition: CompositionConfig) -> dict:
    """256 running and 10,000 waiting, requests finishing and admitted every step (each one
    replaced by a new arrival outside the timed calls): the admission order chooses every step."""
    block_size = 16
    per_req = (CHURN_PREFIX_LEN + CHURN_SUFFIX_LEN + 96) // block_size + 1
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=num_running, composition=composition),
        CacheConfig(block_size=block_size, num_blocks=num_running * per_req + 8 * CHURN_PREFIXES))
    counter = iter(range(10**9))
    for _ in range(num_running + num_waiting):
        sched.add_request(churn_request(next(counter)))
    sched.bench_now = 20.0  # type: ignore[attr-defined]
    run_steps(sched, 400)  # through the first admissions, into steady churn

    def run(sched: Scheduler, n: int) -> float:
        now = sched.bench_now  # type: ignore[attr-defined]
        clock = 0.0
        for _ in range(n):
            start = time.process_time()
            out = sched.schedule(now)
            finished = sched.update_from_output(out, {rid: [7] for rid in out.num_scheduled_tokens}, now)
            clock += time.process_time() - start
            for _ in range(sum(1 for u in finished if u.request.is_finished)):
                sched.add_request(churn_request(next(counter)))
            now += STEP_S
        sched.bench_now = now  # type: ignore[attr-defined]
        return clock

    return timed(sched, steps, run, f"fcfs, churn, {composition.admission_order} order", num_running, num_waiting)


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
    args = parser.parse_args()
    results = [measure(256, 10_000, args.steps), measure(1024, 0, args.steps // 2)]
    results += [measure(256, 10_000, args.steps, "sla"),
                measure(256, 10_000, args.steps, "sla", SLAConfig(tenant_fairness=True)),
                measure(256, 10_000, args.steps, "vtc"),
                measure(256, 10_000, args.steps, composition=CompositionConfig("cache-aware")),
                measure(256, 10_000, args.steps, "priority", composition=CompositionConfig("cache-aware"))]
    results += [measure_churn(256, 10_000, args.steps, CompositionConfig(order))
                for order in ("policy", "cache-aware", "length-aware", "sampling-grouped")]
    hashing = measure_hashing()
    machine = f"{platform.processor() or platform.machine()}, {platform.python_implementation()} {platform.python_version()}"
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "scheduler.json").write_text(json.dumps({"machine": machine, "results": results, "hashing": hashing}, indent=2))
    lines = ["# Scheduler overhead", "",
             "CPU time (`time.process_time`) of one `schedule()` + `update_from_output()` in steady "
             "decode, no model; every running request decodes one token per step.", "",
             f"Command: `.venv/bin/python benchmarks/scheduler_overhead.py --steps {args.steps}`  ",
             f"Machine: {machine}, 2 shared cores (noisy, +-15%).", "",
             "| policy | running | waiting | CPU ms / step | us / running request |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['policy']} | {r['num_running']} | {r['num_waiting']} | {r['cpu_ms_per_step']} "
                     f"| {r['us_per_running_request']} |")
    lines += ["", "Target: <= 1 ms per step at 256 running + 10k waiting, for every policy. The policy "
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
              "running requests, about 2-3 us each: `update_from_output` (append the token, stop "
              "checks, publish a block every `block_size` tokens) is about half, `allocate_slots` "
              "(a new block every 16 tokens, otherwise arithmetic) about a quarter, and building "
              "the `SchedulerOutput` records the rest. Per-request cost grows at 1,024 running "
              "(cache misses on the larger working set).", "",
              "The policy cases add to that: the feedback of every step (`StepServed`, one column per "
              "field, and for `vtc` and tenant fairness the counters charged per tenant), and for "
              "`sla` the admission attempt of the queue's head every step: the threshold walk that "
              "finds it (a few dozen entries when many due times are close, as with this burst) and "
              "the lower bound over the running requests that shows it can preempt none. Objects "
              "allocated per request per step and kept to the step's end (a feedback record, a copy "
              "of the sampled tokens, an empty block list) used to push CPython's collector into "
              "passes over every object of the 10,000 waiting requests, 0.1-0.3 ms per step in the "
              "policy cases; the step allocates none of them now.", ""]
    for r in results:
        lines += [f"## Profile: {r['policy']}, {r['num_running']} running, {r['num_waiting']} waiting "
                  "(top by own time)",
                  "", "```", r["profile_top"], "```", ""]
    (OUT / "scheduler.md").write_text("\n".join(lines))
    for r in results:
        print(f"{r['policy']}: {r['num_running']} running + {r['num_waiting']} waiting: "
              f"{r['cpu_ms_per_step']} ms/step")


if __name__ == "__main__":
    main()

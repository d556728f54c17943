"""CPU cost of the scheduler's stats under `sla`: `get_stats()` against `get_stats(now)`, which
also explains the longest-waiting requests (SchedulerStats.longest_waiting), and of one
`explain_request`. The engine reads get_stats(now) after every step, so its cost is a per-step
cost. The scheduler is scheduler_overhead.py's: 256 running decodes, 10,000 waiting, the SLO
mix (`sla`) and the batch-only backlog (`sla, batch-only backlog`: the 256 oldest requests are
the running ones, so the walk to the longest-waiting passes all of them).

Blocks of calls, the two variants alternating block by block (the machine is shared: a burst
of another job lands on a block of one, not on all of them); the median over blocks. Writes
docs/benchmarks/sla_stats_cost.json and prints markdown.

    flock -x /work/notes/cpu.lock .venv/bin/python benchmarks/sla_stats_cost.py [--blocks 20] [--calls 500]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scheduler_overhead import batch_backlog_hints, build, mixed_hints, run_steps, settle  # noqa: E402

from tokenweir.core.scheduler import Scheduler  # noqa: E402
from tokenweir.request import SchedulingHints  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
CASES: dict[str, Callable[[int], SchedulingHints]] = {"sla": mixed_hints, "sla, batch-only backlog": batch_backlog_hints}


def per_call_us(fn: Callable[[], object], calls: int) -> float:
    start = time.process_time()
    for _ in range(calls):
        fn()
    return (time.process_time() - start) / calls * 1e6


def measure(name: str, hints_of: Callable[[int], SchedulingHints], blocks: int, calls: int) -> dict:
    sched: Scheduler = build(256, 10_000, policy="sla", hints_of=hints_of)
    settle(sched)
    run_steps(sched, 50)
    now = sched.bench_now  # type: ignore[attr-defined]
    longest = sched.get_stats(now).longest_waiting
    walked = 0  # requests the walk passes to find them
    for request in sched.requests.values():
        walked += 1
        if request.request_id == list(longest)[-1]:
            break
    oldest = next(iter(longest))
    plain, with_now, explain = [], [], []
    for _ in range(blocks):
        plain.append(per_call_us(sched.get_stats, calls))
        with_now.append(per_call_us(lambda: sched.get_stats(now), calls))
        explain.append(per_call_us(lambda: sched.explain_request(oldest, now), calls))
    step_us = []
    for _ in range(5):
        start = time.process_time()
        run_steps(sched, 100)
        step_us.append((time.process_time() - start) / 100 * 1e6)
    return {"case": name, "num_running": len(sched.running), "num_waiting": len(sched.waiting),
            "longest_waiting": len(longest), "requests_walked": walked,
            "get_stats_us": statistics.median(plain), "get_stats_now_us": statistics.median(with_now),
            "explain_request_us": statistics.median(explain), "step_us": statistics.median(step_us),
            "blocks": blocks, "calls_per_block": calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=20)
    parser.add_argument("--calls", type=int, default=500)
    ns = parser.parse_args()
    rows = [measure(name, hints_of, ns.blocks, ns.calls) for name, hints_of in CASES.items()]
    report = {"machine": f"{platform.machine()}, CPython {platform.python_version()}",
              "command": f"benchmarks/sla_stats_cost.py --blocks {ns.blocks} --calls {ns.calls}", "rows": rows}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "sla_stats_cost.json").write_text(json.dumps(report, indent=2))
    print(f"{report['machine']}; medians over {ns.blocks} blocks of {ns.calls} calls, CPU us\n")
    print("| case | get_stats() | get_stats(now) | difference | explain_request | requests walked | "
          "one step (schedule + update) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['get_stats_us']:.1f} | {r['get_stats_now_us']:.1f} "
              f"| {r['get_stats_now_us'] - r['get_stats_us']:+.1f} | {r['explain_request_us']:.1f} "
              f"| {r['requests_walked']} | {r['step_us']:.0f} |")


if __name__ == "__main__":
    main()

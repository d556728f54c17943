"""The pause of one full collection of CPython's cyclic collector in a loaded engine process,
with its startup heap left in the collector's generations and frozen (engine/gc_heap.py, what
`tokenweir serve`'s engine process does once the model is loaded). A full collection walks
every tracked object, and the engine loop stops while it runs: every running request's next
token waits for it.

Two states: right after loading, and with a backlog of waiting requests (their Request objects
and token lists are serving's own, never frozen). CPU time of `gc.collect()`, the median of
--repeats. Writes docs/benchmarks/gc_pause.md (+ .json).

    flock -x /work/notes/cpu.lock .venv/bin/python benchmarks/gc_pause.py [--waiting 10000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import time
from pathlib import Path

from tokenweir.config import EngineArgs
from tokenweir.engine.core import EngineCore
from tokenweir.engine.gc_heap import freeze_startup_heap
from tokenweir.machine import cpu_name
from tokenweir.request import SamplingParams

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"


def full_collection_ms(repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        gc.collect()
        times.append((time.process_time() - start) * 1e3)
    return statistics.median(times)


def measure(repeats: int) -> dict:
    return {"tracked_objects": len(gc.get_objects()), "full_collection_ms": round(full_collection_ms(repeats), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--waiting", type=int, default=10_000, help="requests of the backlog")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    core = EngineCore(EngineArgs())  # the default model, as `tokenweir serve` loads it
    rows = {"after loading, not frozen": measure(args.repeats)}
    frozen = freeze_startup_heap()
    rows["after loading, startup heap frozen"] = measure(args.repeats)
    params = SamplingParams(max_tokens=64)
    for i in range(args.waiting):  # never stepped: a backlog, as under overload
        core.add_request(f"w{i}", [(7 * i + j) % 40_000 + 100 for j in range(256)], params)
    rows[f"{args.waiting:,} waiting, startup heap frozen"] = measure(args.repeats)
    gc.unfreeze()
    rows[f"{args.waiting:,} waiting, not frozen"] = measure(args.repeats)
    machine = f"{cpu_name()}, {platform.python_implementation()} {platform.python_version()}"
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gc_pause.json").write_text(json.dumps({"machine": machine, "frozen_objects": frozen,
                                                    "waiting": args.waiting, "rows": rows}, indent=2))
    lines = ["# Full-collection pause in a loaded engine process", "",
             "CPU time of one `gc.collect()` (median of "
             f"{args.repeats}) with the default model loaded by `EngineCore`, as in `tokenweir serve`'s "
             "engine process; the backlog's requests are added, never stepped (256-token prompts).", "",
             f"Command: `.venv/bin/python benchmarks/gc_pause.py --waiting {args.waiting} --repeats {args.repeats}`  ",
             f"Machine: {machine}, 2 shared cores.  ",
             f"Objects frozen by `freeze_startup_heap()`: {frozen:,}.", "",
             "| state | tracked objects the collector walks | full collection, CPU ms |", "|---|---|---|"]
    lines += [f"| {name} | {r['tracked_objects']:,} | {r['full_collection_ms']:.2f} |" for name, r in rows.items()]
    lines += ["", "CPython 3.11 runs a full collection once the objects moved into the oldest generation "
              "since the last one exceed a quarter of those already there (after 100 young "
              "collections), so how often it comes depends on the traffic; how long it stops the engine "
              "loop is the walk above. Frozen, the startup heap is neither walked nor counted in that "
              "quarter: full collections come more often, and each walks only what serving holds.", ""]
    (OUT / "gc_pause.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""CPython's cyclic collector beside an engine that lives as long as its process.

Once the engine has started, what is alive (the model's modules and parameters, the tokenizer,
the imported libraries: some 300,000 tracked objects for the default model) stays alive until
the process exits, yet every full collection walks all of it: a pause inside one engine step,
which every running request waits for (docs/benchmarks/gc_pause.md). vLLM's engine core freezes
its startup heap for the same reason.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect what loading left behind, then move every live object to the collector's
    permanent generation (gc.freeze), so that later collections walk only what serving
    allocates. Frozen objects are never collected: only for a process that keeps its one engine
    until it exits (serve's engine process, or serve's own with --engine-in-process), never for
    one that builds and drops engines (tests, LLM in a script). Returns how many were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()

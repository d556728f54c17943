"""Torch intra-op threads for a serving process: a small step leaves one core to the serving path.

In `tokenweir serve` the engine thread runs each op as an OpenMP team, while the event loop
(HTTP, SSE formatting, the hand-off of each output) and the clients on the same host need a
core at every token. With a team as wide as the machine, one of its threads is preempted at
every token and each op's barrier waits for it; spin-waiting team threads also take the core
the event loop wants. That dominates a step of a few requests; a step of many requests gains
more from the full team than it loses to the event loop, so it keeps all the threads.
Offline (`LLM.generate`) nothing else runs, so it keeps torch's default throughout.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

logger = logging.getLogger("tokenweir")

# Up to this many requests in the engine, a step runs with one core left free.
SMALL_STEP_MAX_REQUESTS = 4


class ServingThreads:
    """Picks the intra-op thread count before each engine step."""

    def __init__(self, full: int, reserved: int) -> None:
        self.full, self.reserved = full, reserved
        self._current = torch.get_num_threads()

    def before_step(self, num_requests: int) -> None:
        threads = self.reserved if num_requests <= SMALL_STEP_MAX_REQUESTS else self.full
        if threads != self._current:
            torch.set_num_threads(threads)
            self._current = threads


_serving: Optional[ServingThreads] = None


def reserve_core_for_serving() -> Optional[ServingThreads]:
    """Enable per-step thread choice in this process (`tokenweir serve`). An explicit
    OMP_NUM_THREADS is the user's choice and is left alone; so is a single core."""
    global _serving
    full = torch.get_num_threads()
    reserved = min(full, len(os.sched_getaffinity(0)) - 1)
    if "OMP_NUM_THREADS" in os.environ or reserved < 1 or reserved == full:
        _serving = None
    else:
        _serving = ServingThreads(full, reserved)
        logger.info("torch intra-op threads: %d, %d for steps of up to %d requests",
                    full, reserved, SMALL_STEP_MAX_REQUESTS)
    return _serving


def before_step(num_requests: int) -> None:
    """Called by the async engine's thread before each step; a no-op unless enabled."""
    if _serving is not None:
        _serving.before_step(num_requests)

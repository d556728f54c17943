"""Torch intra-op threads for a serving process: a small step leaves one core to the serving path.

In `tokenweir serve` the engine thread runs each op as an OpenMP team, while the event loop
(HTTP, SSE formatting, the hand-off of each output) and the clients on the same host need a
core at every token. With a team as wide as the machine, one of its threads is preempted at
every token and each op's barrier waits for it; spin-waiting team threads also take the core
the event loop wants. That dominates a step of a few decode tokens; a step of many tokens (many
decodes, or any prefill chunk) gains more from the full team than it loses to the event loop,
so it keeps all the threads: a prompt on one thread fewer waits that much longer for its first
token.
Offline (`LLM.generate`) nothing else runs, so it keeps torch's default throughout.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import torch

logger = logging.getLogger("tokenweir")

# Up to this many scheduled tokens, a step runs with one core left free.
SMALL_STEP_MAX_TOKENS = 4


class ServingThreads:
    """Picks the intra-op thread count before each engine step."""

    def __init__(self, full: int, reserved: int) -> None:
        self.full, self.reserved = full, reserved
        self._current = torch.get_num_threads()

    def before_step(self, num_scheduled_tokens: int) -> None:
        threads = self.reserved if num_scheduled_tokens <= SMALL_STEP_MAX_TOKENS else self.full
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
        logger.info("torch intra-op threads: %d, %d for steps of up to %d tokens",
                    full, reserved, SMALL_STEP_MAX_TOKENS)
    return _serving


def before_step(num_scheduled_tokens: int) -> None:
    """Called by the async engine's thread once a step is scheduled, before the model runs; a
    no-op unless enabled."""
    if _serving is not None:
        _serving.before_step(num_scheduled_tokens)

"""Torch intra-op threads for a serving process: one core is left to the serving path.

In `tokenweir serve` the engine thread runs each op as an OpenMP team, while the event loop
(HTTP, SSE formatting, the hand-off of each output) and the clients on the same host need a
core at every token. With a team as wide as the machine, one of its threads is preempted at
every token and each op's barrier waits for it; spin-waiting team threads also take the core
the event loop wants. Offline (`LLM.generate`) nothing else runs, so it keeps torch's default.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger("tokenweir")


def reserve_core_for_serving() -> int:
    """Use one intra-op thread fewer than this process's cores (at least one); returns the
    thread count. An explicit OMP_NUM_THREADS is the user's choice and is left alone."""
    if "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, len(os.sched_getaffinity(0)) - 1)
        if threads < torch.get_num_threads():
            torch.set_num_threads(threads)
    logger.info("torch intra-op threads: %d", torch.get_num_threads())
    return torch.get_num_threads()

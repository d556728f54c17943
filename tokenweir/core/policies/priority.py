from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter

from tokenweir.core.policies.base import SchedulingPolicy
from tokenweir.core.queues import KeyedQueue, RequestQueue
from tokenweir.request import Request


# (priority, arrival_time, request_id) of a request. A total order: with ties left to list
# order, a re-admitted victim could outrank the request that preempted it, and two equal
# requests would preempt each other forever. An attrgetter (C) rather than a function: the
# victim search applies it to every running request each time the queue's head tries to get in.
priority_key: Callable[[Request], tuple[int, float, str]] = attrgetter("hints.priority", "arrival_time", "request_id")


class PriorityPolicy(SchedulingPolicy):
    """Smaller `priority` first, then earlier arrival, then request id. The victim is the
    running request that sorts last, and a waiting request may preempt any running request
    that sorts after it."""

    name = "priority"

    def make_waiting_queue(self) -> RequestQueue:
        # Band: equal priority (composition reorders only among those: core/composition.py).
        return KeyedQueue(priority_key, band_key=lambda r: r.priority)

    def select_victim(self, running: Sequence[Request], now: float) -> Request:
        return max(running, key=priority_key)

    def may_preempt(self, waiting: Request, victim: Request, now: float) -> bool:
        return priority_key(waiting) < priority_key(victim)

    def may_overtake(self, request: Request, ahead: Request, now: float) -> bool:
        return request.priority == ahead.priority  # within a level, the rank is arrival order

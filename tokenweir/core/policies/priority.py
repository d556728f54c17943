from __future__ import annotations

from collections.abc import Sequence

from tokenweir.core.policies.base import SchedulingPolicy
from tokenweir.core.queues import KeyedQueue, RequestQueue
from tokenweir.request import Request


def priority_key(request: Request) -> tuple[int, float, str]:
    # A total order: with ties left to list order, a re-admitted victim could outrank the
    # request that preempted it, and two equal requests would preempt each other forever.
    return (request.priority, request.arrival_time, request.request_id)


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

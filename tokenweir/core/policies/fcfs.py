from __future__ import annotations

from collections.abc import Sequence

from tokenweir.core.policies.base import SchedulingPolicy
from tokenweir.core.queues import FCFSQueue, RequestQueue
from tokenweir.request import Request


class FCFSPolicy(SchedulingPolicy):
    """Strict arrival order; the most recently admitted request is preempted first."""

    name = "fcfs"

    def make_waiting_queue(self) -> RequestQueue:
        return FCFSQueue()

    def select_victim(self, running: Sequence[Request], now: float) -> Request:
        return running[-1]

    def head_may_preempt(self, waiting: RequestQueue, now: float) -> bool:
        # may_preempt is never true (unless a subclass says otherwise): at a full batch no one
        # is admitted, so the step need not pop and try its next request (a prefix lookup and
        # a chunk cut for nothing).
        return type(self).may_preempt is not SchedulingPolicy.may_preempt

    def may_overtake(self, request: Request, ahead: Request, now: float) -> bool:
        return True  # arrival order is the only rank

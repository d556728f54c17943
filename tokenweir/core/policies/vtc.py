"""`vtc`: per-tenant fair share by Virtual Token Counters (see fair_share.py).

Admission takes the backlogged tenant with the smallest counter, and within a tenant the
earliest arrival. The victim under KV pressure is the latest arrival of the running tenant with
the largest counter. A waiting request never preempts a running one for fairness: VTC shares by
admission order, and preempting for it would charge recomputation to nobody and thrash.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator, Sequence

from tokenweir.core.policies.base import SchedulingPolicy, ServedRequest
from tokenweir.core.policies.fair_share import Tenant, VirtualTokenCounters, VTCConfig
from tokenweir.core.queues import RequestQueue
from tokenweir.request import Request


class TenantQueue(RequestQueue):
    """One FIFO per tenant; `pop` takes from the tenant the counters say is furthest behind."""

    def __init__(self, counters: VirtualTokenCounters) -> None:
        self.counters = counters
        self._queues: dict[Tenant, deque[Request]] = {}
        self._len = 0

    def _put(self, request: Request, front: bool) -> None:
        tenant = request.tenant
        queue = self._queues.get(tenant)
        if queue is None:
            queue = self._queues[tenant] = deque()
        queue.appendleft(request) if front else queue.append(request)
        self.counters.put_back(request) if front else self.counters.add_waiting(tenant)
        self._len += 1

    def add(self, request: Request) -> None:
        self._put(request, front=False)

    def push_front(self, request: Request) -> None:
        self._put(request, front=True)

    def _take(self, tenant: Tenant, request: Request | None = None) -> Request:
        queue = self._queues[tenant]
        if request is None:
            request = queue.popleft()
        else:
            queue.remove(request)  # O(tenant's queue), only on abort
        if not queue:
            del self._queues[tenant]
        self.counters.remove_waiting(tenant)
        self._len -= 1
        return request

    def _next_tenant(self) -> Tenant:
        tenant = self.counters.min_backlogged()
        if tenant not in self._queues:
            # The counters' backlog spans the waiting and the swapped queue, which share them:
            # the tenant furthest behind may have requests only in the other one.
            tenant = self.counters.min_backlogged(among=self._queues)
        return tenant

    def pop(self) -> Request:
        tenant = self._next_tenant()
        self.counters.note_chosen(self._queues[tenant][0])  # before it leaves: its tenant may be pruned
        request = self._take(tenant)
        self.counters.charge_admission(request)
        return request

    def remove(self, request: Request) -> None:
        self._take(request.tenant, request)

    def band(self, limit: int) -> Sequence[Request]:
        # The tenant VTC serves next: reordering within it leaves the tenants' shares alone.
        if not self._len:
            return ()
        return list(itertools.islice(self._queues[self._next_tenant()], limit))

    def same_band(self, a: Request, b: Request) -> bool:
        return a.tenant == b.tenant

    def take(self, request: Request) -> None:
        tenant = request.tenant
        self.counters.note_chosen(request)
        queue = self._queues[tenant]
        self._take(tenant, None if queue[0] is request else request)
        self.counters.charge_admission(request)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        return (r for q in self._queues.values() for r in q)


class VTCPolicy(SchedulingPolicy):
    name = "vtc"
    config_class = VTCConfig

    def __init__(self, config: VTCConfig | None = None) -> None:
        super().__init__(config)
        self.counters = VirtualTokenCounters(self.config)

    def make_waiting_queue(self) -> RequestQueue:
        return TenantQueue(self.counters)

    def end_step(self, now: float) -> None:
        self.counters.drop_provisional()

    def select_victim(self, running: Sequence[Request], now: float) -> Request:
        counter = self.counters.counter
        return max(running, key=lambda r: (counter(r.tenant), r.arrival_time, r.request_id))

    def may_overtake(self, request: Request, ahead: Request, now: float) -> bool:
        return request.tenant == ahead.tenant  # across tenants the counters rank

    def on_step_served(self, served: Sequence[ServedRequest], now: float) -> None:
        self.counters.charge(served)

    def get_stats(self) -> dict[str, object]:
        return {"tenant_counters": self.counters.snapshot()}

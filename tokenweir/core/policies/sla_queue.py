"""The waiting queue of `sla`: the highest score first, without re-scoring every request.

A score (sla_score.py) is `static_key + aging_rate * now + A * urgency + class terms`, where the
static key does not change while a request waits, A = urgency_weight * load_adjustment is the
same for every request at one time, and urgency depends on the request's due time (fixed while
it waits): it grows as the due time nears and fades after it. So within one class the best
request is found with Fagin's threshold algorithm over heaps by a static value and by due time
(see _ScoredHeaps): walk them in order, score what is seen exactly, stop once nothing unseen
can beat the best. The cost is then a few heap operations per class per pop, not one score per
waiting request.

Classes are the priority classes; with tenant fairness each class holds one such set of heaps
per tenant and takes the tenant VTC says is furthest behind. Requests that have waited
`max_wait` leave the heaps for the aged FIFO, served before everything else.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Optional

from tokenweir.core.policies.fair_share import Tenant, VirtualTokenCounters
from tokenweir.core.policies.sla_score import SLAConfig, due_time, priority_class, static_key, urgency
from tokenweir.core.queues import RequestQueue
from tokenweir.request import Request


@dataclass(slots=True, eq=False)
class _Entry:
    request: Request
    key: float  # static_key
    due: float  # due_time, inf without an SLO
    seq: int
    shifted: float = 0.0  # key + aging_rate * due (with a due time)
    alive: bool = True
    seen: int = -1  # the walk of best() that last scored it


_Item = tuple[float, int, _Entry]
# A walk stops only with this much (relative) to spare: its bound sums the score's terms in
# another order than the score itself, which may round the other way.
_SLACK = 1e-9


class _ScoredHeaps:
    """One class's (or one tenant's in a class) waiting requests, best score found by TA.

    With a due time, score = key + scale * urgency(due) = shifted + f(due), shifted = key +
    aging_rate * due (fixed while waiting) and f(due) = scale * urgency(due) - aging_rate * due
    (the same function for every entry at one time). f is convex on each side of `now` (the
    sigmoid is convex below 0) and falls with due after `now`, so over any range of due times
    it is largest at an end: the unseen entries not yet due score at most f(the earliest of
    them), the unseen late ones at most f(the latest or the oldest of them). The walk takes,
    round by round, the next entry of four orders, shifted (largest first), pending due times
    (earliest first), late due times (latest first, and oldest first), scoring each once,
    and stops when nothing unseen can beat the best: largest unseen shifted + the largest f
    at the unseen ends. Requests of one kind have nearly one shifted value (aging cancels
    against the due time), so the walk ends after a few rounds even in a burst of close due
    times or a backlog of late requests. Without a due time the score is the key: the
    largest key is the best of those."""

    def __init__(self) -> None:
        self.by_key: list[_Item] = []  # (-key, ...) of entries without a due time
        self.by_shifted: list[_Item] = []  # (-shifted, ...) of entries with one
        self.pending: list[_Item] = []  # (due, ...), due > now when last moved
        self.late: list[_Item] = []  # (-due, ...)
        self.late_oldest: list[_Item] = []  # (due, ...): the same entries as late
        self.live = 0
        self._dead = 0
        self._walks = itertools.count()

    def add(self, entry: _Entry) -> None:
        if entry.due == math.inf:
            heapq.heappush(self.by_key, (-entry.key, entry.seq, entry))
        else:
            heapq.heappush(self.by_shifted, (-entry.shifted, entry.seq, entry))
            heapq.heappush(self.pending, (entry.due, entry.seq, entry))
        self.live += 1

    def kill(self, entry: _Entry) -> None:
        entry.alive = False
        self.live -= 1
        self._dead += 1
        if self._dead > self.live + 64:  # drop dead entries now and then
            for name in ("by_key", "by_shifted", "pending", "late", "late_oldest"):
                heap = [e for e in getattr(self, name) if e[2].alive]
                heapq.heapify(heap)
                setattr(self, name, heap)
            self._dead = 0

    def _advance(self, now: float) -> None:
        pending = self.pending
        while pending and pending[0][0] <= now:
            due, seq, entry = heapq.heappop(pending)
            if entry.alive:
                heapq.heappush(self.late, (-due, seq, entry))
                heapq.heappush(self.late_oldest, (due, seq, entry))

    def best(self, now: float, scale: float, window: float, aging: float) -> tuple[float, _Entry]:
        """(score without the terms common to the class, entry) of the best live entry:
        key + scale * urgency(now, due), ties to the earliest put."""
        self._advance(now)
        best_score, best_entry = -math.inf, None
        by_key = self.by_key
        while by_key and not by_key[0][2].alive:
            heapq.heappop(by_key)
        if by_key:
            best_score, best_entry = -by_key[0][0], by_key[0][2]
        heaps = (self.by_shifted, self.pending, self.late, self.late_oldest)
        taken: tuple[list[_Item], ...] = ([], [], [], [])
        walk = next(self._walks)
        try:
            while True:
                for heap, items in zip(heaps, taken):
                    while heap:
                        item = heapq.heappop(heap)
                        e = item[2]
                        if not e.alive:
                            continue
                        items.append(item)
                        if e.seen != walk:
                            e.seen = walk
                            s = e.key + scale * urgency(now, e.due, window)
                            if s > best_score or (s == best_score and e.seq < best_entry.seq):
                                best_score, best_entry = s, e
                        break
                # Heads left (dead ones too) bound what is unseen: see the class docstring.
                if not heaps[0]:
                    break
                ends = []
                if self.pending:
                    ends.append(self.pending[0][0])
                if self.late and self.late_oldest:  # unseen late ones are left in both
                    ends.append(-self.late[0][0])
                    ends.append(self.late_oldest[0][0])
                if not ends:
                    break
                bound = -heaps[0][0][0] + max(scale * urgency(now, due, window) - aging * due for due in ends)
                if best_score >= bound + _SLACK * (1.0 + abs(bound)):
                    break
        finally:
            for heap, items in zip(heaps, taken):
                for item in items:
                    heapq.heappush(heap, item)
        assert best_entry is not None
        return best_score, best_entry

    def entries(self) -> Iterator[_Entry]:
        for heap in (self.by_key, self.by_shifted):
            yield from (item[2] for item in heap if item[2].alive)


class SLAQueue(RequestQueue):
    """Waiting requests of `sla`. The policy sets the time-dependent terms (`now`, the urgency
    scale, each class's compensation) in `begin_step` before anything is popped."""

    def __init__(self, cfg: SLAConfig, counters: Optional[VirtualTokenCounters],
                 on_added: Callable[[Request], None], on_popped: Callable[[Request], None]) -> None:
        self.cfg = cfg
        self.counters = counters  # tenant fairness within a class; None: off
        self._on_added = on_added  # a new arrival (not a request put back)
        self._on_popped = on_popped
        self._classes: list[dict[Tenant, _ScoredHeaps]] = [{} for _ in range(cfg.num_priority_classes)]
        self._entries: dict[str, _Entry] = {}
        self._by_arrival: list[tuple[float, int, _Entry]] = []  # to find who reaches max_wait
        self._aged: deque[Request] = deque()
        self._seq = itertools.count()
        self.now = 0.0
        self.urgency_scale = cfg.urgency_weight
        self.class_terms = [0.0] * cfg.num_priority_classes  # fairness compensation per class

    # ------------------------------------------------------------ RequestQueue

    def add(self, request: Request) -> None:
        self._put(request, front=False)
        self._on_added(request)

    def push_front(self, request: Request) -> None:
        self._put(request, front=True)

    def _put(self, request: Request, front: bool) -> None:
        if self.counters is not None:
            self.counters.add_waiting(request.tenant)
        if self.now - request.arrival_time >= self.cfg.max_wait:
            self._aged.appendleft(request) if front else self._aged.append(request)
            return
        key, due = static_key(request, self.cfg), due_time(request)
        entry = _Entry(request, key, due, next(self._seq), key + self.cfg.aging_rate * due if due != math.inf else key)
        self._entries[request.request_id] = entry
        self._heaps(request).add(entry)
        heapq.heappush(self._by_arrival, (request.arrival_time, entry.seq, entry))

    def _heaps(self, request: Request) -> _ScoredHeaps:
        tenants = self._classes[priority_class(request.priority, self.cfg.num_priority_classes)]
        tenant = request.tenant if self.counters is not None else None
        heaps = tenants.get(tenant)
        if heaps is None:
            heaps = tenants[tenant] = _ScoredHeaps()
        return heaps

    def _kill(self, entry: _Entry) -> None:
        del self._entries[entry.request.request_id]
        request = entry.request
        tenants = self._classes[priority_class(request.priority, self.cfg.num_priority_classes)]
        tenant = request.tenant if self.counters is not None else None
        heaps = tenants[tenant]
        heaps.kill(entry)
        if not heaps.live:
            del tenants[tenant]

    def _left(self, request: Request) -> Request:
        if self.counters is not None:
            self.counters.remove_waiting(request.tenant)
        return request

    def pop(self) -> Request:
        if self._aged:
            request = self._aged.popleft()
        else:
            _, entry = self.best()
            self._kill(entry)
            request = entry.request
            if self.counters is not None:
                self.counters.note_chosen(request.tenant)
        self._on_popped(request)
        return self._left(request)

    def remove(self, request: Request) -> None:
        entry = self._entries.get(request.request_id)
        if entry is not None and entry.request is request:
            self._kill(entry)
        else:
            self._aged.remove(request)  # O(aged), only on abort
        self._left(request)

    def __len__(self) -> int:
        return len(self._entries) + len(self._aged)

    def __iter__(self) -> Iterator[Request]:
        yield from self._aged
        for tenants in self._classes:
            for heaps in tenants.values():
                yield from (e.request for e in heaps.entries())

    # ------------------------------------------------------------ the policy's side

    def best(self) -> tuple[float, _Entry]:
        """The best scored entry (not aged) and its score, less the terms all requests share."""
        cfg, now, scale = self.cfg, self.now, self.urgency_scale
        best_score, best_entry = -math.inf, None
        for cls, tenants in enumerate(self._classes):
            if not tenants:
                continue
            if self.counters is not None and len(tenants) > 1:
                heaps = tenants[self.counters.min_backlogged(among=tenants)]
            else:
                heaps = next(iter(tenants.values()))
            score, entry = heaps.best(now, scale, cfg.time_window, cfg.aging_rate)
            score += self.class_terms[cls]
            if best_entry is None or score > best_score:
                best_score, best_entry = score, entry
        if best_entry is None:
            raise IndexError("pop from an empty queue")
        return best_score, best_entry

    def age(self, now: float) -> None:
        """Move the requests that have waited max_wait to the aged FIFO, oldest first."""
        self.now = now
        horizon = now - self.cfg.max_wait
        heap = self._by_arrival
        while heap and heap[0][0] <= horizon:
            _, _, entry = heapq.heappop(heap)
            if entry.alive:
                self._kill(entry)
                self._aged.append(entry.request)
        if len(heap) > 2 * len(self._entries) + 64:
            self._by_arrival = [item for item in heap if item[2].alive]
            heapq.heapify(self._by_arrival)

"""The waiting queue of `sla`: the highest score first, without re-scoring every request.

A score (sla_score.py) is `static_key + aging_rate * now + A * urgency + class terms`, where the
static key does not change while a request waits, A = urgency_weight * load_adjustment is the
same for every request at one time, and urgency depends on the request's due time (fixed while
it waits): it grows as the due time nears and fades after it. So within one class the best
request is found with Fagin's threshold algorithm over heaps by a static value and by due time
(see _ScoredHeaps): walk them in order, score what is seen exactly, stop once nothing unseen
can beat the best. The cost is then some heap operations per pop (tens while a late backlog's
two ends score alike), not one score per waiting request.

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
    late: bool = False  # moved from the pending heaps to the late ones
    seen: int = -1  # the walk of best() that last scored it


# (order value, entry seq): numbers only, so CPython's collector untracks the tuple after the
# first collection it survives. Every waiting request has up to seven of them (dead ones too,
# until compaction); holding the entry itself would keep them tracked, and every full
# collection would walk them all (under churn that was most of what sla paid for it). The
# entry is found by its seq among the live ones: a seq not there is a dead item.
_Item = tuple[float, int]
# A walk stops only with this much (relative) to spare: its bound sums the score's terms in
# another order than the score itself, which may round the other way.
_SLACK = 1e-9


def _spare(bound: float) -> float:
    """A bound plus the slack that makes "best >= it" safe from rounding."""
    return bound + _SLACK * (1.0 + abs(bound))


def _late_points(oldest: float, latest: float, now: float, scale: float, window: float,
                 aging: float) -> list[tuple[float, float, float]]:
    """(due, f(due), scale * urgency) at due times inside (oldest, latest), ascending: half a
    window, one, two, four, ... in from each end, to the middle (see _split_late_bound)."""
    middle = (oldest + latest) / 2
    dues = []
    step = window / 2
    while oldest + step < middle:
        dues.append(oldest + step)
        dues.append(latest - step)
        step *= 2
    if oldest < middle < latest:
        dues.append(middle)
    points = []
    for due in sorted(dues):
        u = scale * urgency(now, due, window)
        points.append((due, u - aging * due, u))
    return points


def _split_late_bound(points: list[tuple[float, float, float]], oldest: float, latest: float, f_oldest: float,
                      f_latest: float, u_latest: float, top_shifted: float, top_key: float) -> float:
    """At least the score of every unseen late entry, its due time in [oldest, latest], range
    by range between the points: in [a, b] one scores at most top_shifted + max(f(a), f(b)) (f is
    convex) and at most top_key + scale * urgency(b) (urgency grows towards now). The first
    bound is tight at the range's two ends, the second at the old end where urgency is flat;
    over the whole range at once each is loose in the other's place, where the best entry may
    be (a late backlog whose oldest and newest ends score alike)."""
    bound = -math.inf
    f_a = f_oldest
    for due, f, u in points:
        if due <= oldest:
            continue
        if due >= latest:
            break
        bound = max(bound, min(top_shifted + max(f_a, f), top_key + u))
        f_a = f
    return max(bound, min(top_shifted + max(f_a, f_latest), top_key + u_latest))


class _ScoredHeaps:
    """One class's (or one tenant's in a class) waiting requests, best score found by TA.

    With a due time, score = key + scale * urgency(due) = shifted + f(due), shifted = key +
    aging_rate * due (fixed while waiting) and f(due) = scale * urgency(due) - aging_rate * due
    (the same function for every entry at one time). f is convex on each side of `now` (the
    sigmoid is convex below 0) and falls with due after `now`, so over any range of due times
    it is largest at an end: the unseen entries not yet due score at most the largest unseen
    shifted + f(the earliest of them), the unseen late ones at most that shifted + f(the latest
    or the oldest of them). Requests of one kind have nearly one shifted value (aging cancels
    against the due time), so near `now`, where urgency moves fast with the due time, this
    bound is tight. Far from `now` urgency is flat and the score is nearly the key, but then
    the small spread of shifted (the size term, some 0.003 across prompt lengths) is as large
    as f's change from one entry to the next (aging over the milliseconds between arrivals),
    and that bound walks every entry of the larger shifted values, some 100 in a late backlog
    of 3,000. So each side also has a heap by key, bounding its unseen entries by the largest
    unseen key + scale * the urgency at the side's end nearest `now` (urgency falls away from
    `now`): tight where urgency is flat. The walk takes, round by round, the next entry of the
    six orders, scoring each once, and stops when nothing unseen can beat the best: on each
    side the smaller of its two bounds. Without a due time the score is the key: the largest
    key is the best of those."""

    def __init__(self) -> None:
        self.by_key: list[_Item] = []  # (-key, ...) of entries without a due time
        self.by_shifted: list[_Item] = []  # (-shifted, ...) of entries with one
        self.pending: list[_Item] = []  # (due, ...), due > now when last moved
        self.pending_by_key: list[_Item] = []  # (-key, ...): the same entries as pending, late ones left lazily
        self.late: list[_Item] = []  # (-due, ...)
        self.late_oldest: list[_Item] = []  # (due, ...): the same entries as late
        self.late_by_key: list[_Item] = []  # (-key, ...): the same entries as late
        self.entries: dict[int, _Entry] = {}  # the live ones, by seq
        self._dead = 0
        self._walks = itertools.count()

    @property
    def live(self) -> int:
        return len(self.entries)

    def add(self, entry: _Entry) -> None:
        seq = entry.seq
        self.entries[seq] = entry
        if entry.due == math.inf:
            heapq.heappush(self.by_key, (-entry.key, seq))
        else:
            heapq.heappush(self.by_shifted, (-entry.shifted, seq))
            heapq.heappush(self.pending, (entry.due, seq))
            heapq.heappush(self.pending_by_key, (-entry.key, seq))

    def kill(self, entry: _Entry) -> None:
        entries = self.entries
        del entries[entry.seq]
        self._dead += 1
        if self._dead > len(entries) + 64:  # drop dead items now and then
            for name in ("by_key", "by_shifted", "pending", "late", "late_oldest", "late_by_key"):
                heap = [item for item in getattr(self, name) if item[1] in entries]
                heapq.heapify(heap)
                setattr(self, name, heap)
            self.pending_by_key = [item for item in self.pending_by_key
                                   if (e := entries.get(item[1])) is not None and not e.late]
            heapq.heapify(self.pending_by_key)
            self._dead = 0

    def _advance(self, now: float) -> None:
        pending, entries = self.pending, self.entries
        while pending and pending[0][0] <= now:
            due, seq = heapq.heappop(pending)
            entry = entries.get(seq)
            if entry is not None:
                entry.late = True  # its pending_by_key item goes when it reaches the top
                heapq.heappush(self.late, (-due, seq))
                heapq.heappush(self.late_oldest, (due, seq))
                heapq.heappush(self.late_by_key, (-entry.key, seq))
        by_key = self.pending_by_key
        while by_key and ((e := entries.get(by_key[0][1])) is None or e.late):
            heapq.heappop(by_key)

    def upper_bound(self, scale: float) -> float:
        """At least the score (without the class's common terms) of every live entry, from the
        key heaps' heads (dead or stale ones only raise it): urgency is at most 1."""
        bound = -self.by_key[0][0] if self.by_key else -math.inf
        for heap in (self.pending_by_key, self.late_by_key):
            if heap:
                bound = max(bound, -heap[0][0] + scale)
        return bound

    def best(self, now: float, scale: float, window: float, aging: float) -> tuple[float, _Entry]:
        """(score without the terms common to the class, entry) of the best live entry:
        key + scale * urgency(now, due), ties to the earliest put."""
        self._advance(now)
        entries = self.entries
        best_score, best_entry = -math.inf, None
        by_key = self.by_key
        while by_key and by_key[0][1] not in entries:
            heapq.heappop(by_key)
        if by_key:
            best_score, best_entry = -by_key[0][0], entries[by_key[0][1]]
        by_shifted, pending, late, late_oldest = self.by_shifted, self.pending, self.late, self.late_oldest
        pending_by_key, late_by_key = self.pending_by_key, self.late_by_key
        heaps = (by_shifted, pending, late, late_oldest, pending_by_key, late_by_key)
        taken: tuple[list[_Item], ...] = ([], [], [], [], [], [])
        walk = next(self._walks)
        points: Optional[list[tuple[float, float, float]]] = None  # see _late_points
        try:
            while True:
                for heap, items in zip(heaps, taken):
                    while heap:
                        item = heapq.heappop(heap)
                        e = entries.get(item[1])
                        if e is None:
                            continue
                        if heap is pending_by_key and e.late:
                            continue  # it is in late_by_key: dropped for good
                        items.append(item)
                        if e.seen != walk:
                            e.seen = walk
                            s = e.key + scale * urgency(now, e.due, window)
                            if s > best_score or (s == best_score and e.seq < best_entry.seq):
                                best_score, best_entry = s, e
                        break
                # Heads left (dead ones too) bound what is unseen: see the class docstring.
                # An unseen entry is in every heap of its side, so an empty heap proves none.
                if not by_shifted:
                    break
                top_shifted = -by_shifted[0][0]
                bound = -math.inf
                if pending and pending_by_key:
                    due = pending[0][0]
                    u = scale * urgency(now, due, window)
                    bound = min(top_shifted + u - aging * due, -pending_by_key[0][0] + u)
                if late and late_oldest and late_by_key:
                    latest, oldest = -late[0][0], late_oldest[0][0]
                    u_latest = scale * urgency(now, latest, window)
                    u_oldest = scale * urgency(now, oldest, window)
                    top_key = -late_by_key[0][0]
                    late_bound = min(top_shifted + max(u_latest - aging * latest, u_oldest - aging * oldest),
                                     top_key + u_latest)
                    if best_score < _spare(late_bound):
                        if points is None:  # once per walk: the range only shrinks
                            points = _late_points(oldest, latest, now, scale, window, aging)
                        late_bound = _split_late_bound(points, oldest, latest, u_oldest - aging * oldest,
                                                       u_latest - aging * latest, u_latest, top_shifted, top_key)
                    bound = max(bound, late_bound)
                if bound == -math.inf or best_score >= _spare(bound):
                    break
        finally:
            for heap, items in zip(heaps, taken):
                for item in items:
                    heapq.heappush(heap, item)
        assert best_entry is not None
        return best_score, best_entry


class SLAQueue(RequestQueue):
    """Waiting requests of `sla`. The policy sets the time-dependent terms (`now`, the urgency
    scale, each class's compensation) in `begin_step` before anything is popped."""

    def __init__(self, cfg: SLAConfig, counters: Optional[VirtualTokenCounters],
                 on_added: Callable[[Request], None], on_popped: Callable[[Request], None],
                 on_put_back: Callable[[Request], None]) -> None:
        self.cfg = cfg
        self.counters = counters  # tenant fairness within a class; None: off
        self._on_added = on_added  # a new arrival (not a request put back)
        self._on_popped = on_popped
        self._on_put_back = on_put_back  # push_front: passed over, preempted, not swapped in
        self._classes: list[dict[Tenant, _ScoredHeaps]] = [{} for _ in range(cfg.num_priority_classes)]
        self._entries: dict[str, _Entry] = {}
        # (arrival time, seq, request id): to find who reaches max_wait (numbers and a string:
        # untracked by the collector, see _Item); the entry is current if its seq matches.
        self._by_arrival: list[tuple[float, int, str]] = []
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
        self._on_put_back(request)

    def _put(self, request: Request, front: bool) -> None:
        if self.counters is not None:
            self.counters.put_back(request) if front else self.counters.add_waiting(request.tenant)
        if self.now - request.arrival_time >= self.cfg.max_wait:
            self._aged.appendleft(request) if front else self._aged.append(request)
            return
        key, due = static_key(request, self.cfg), due_time(request)
        entry = _Entry(request, key, due, next(self._seq), key + self.cfg.aging_rate * due if due != math.inf else key)
        self._entries[request.request_id] = entry
        self._heaps(request).add(entry)
        heapq.heappush(self._by_arrival, (request.arrival_time, entry.seq, request.request_id))

    def _heaps(self, request: Request) -> _ScoredHeaps:
        tenants = self._classes[priority_class(request.priority, self.cfg.num_priority_classes)]
        tenant = request.tenant if self.counters is not None else None
        heaps = tenants.get(tenant)
        if heaps is None:
            heaps = tenants[tenant] = _ScoredHeaps()
        return heaps

    def _kill(self, entry: _Entry) -> Request:
        """Take a live entry out of the queue; its request."""
        request = entry.request
        del self._entries[request.request_id]
        tenants = self._classes[priority_class(request.priority, self.cfg.num_priority_classes)]
        tenant = request.tenant if self.counters is not None else None
        heaps = tenants[tenant]
        heaps.kill(entry)
        if not heaps.live:
            del tenants[tenant]
        return request

    def _left(self, request: Request) -> Request:
        if self.counters is not None:
            self.counters.remove_waiting(request.tenant)
        return request

    def pop(self) -> Request:
        if self._aged:
            request = self._aged.popleft()
        else:
            _, entry = self.best()
            request = self._kill(entry)
            if self.counters is not None:
                self.counters.note_chosen(request)
        self._on_popped(request)
        self._left(request)
        if self.counters is not None:
            self.counters.charge_admission(request)
        return request

    def peek(self) -> Request:
        """The request pop() would return next, left in the queue."""
        return self._aged[0] if self._aged else self.best()[1].request

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
                yield from (e.request for e in heaps.entries.values())

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
            term = self.class_terms[cls]
            # An earlier class wins ties, so a class that cannot score above the best so far
            # is not walked: by default every class after the first one that holds a request
            # (a priority level outweighs urgency).
            if best_entry is not None and _spare(heaps.upper_bound(scale) + term) <= best_score:
                continue
            score, entry = heaps.best(now, scale, cfg.time_window, cfg.aging_rate)
            score += term
            if best_entry is None or score > best_score:
                best_score, best_entry = score, entry
        if best_entry is None:
            raise IndexError("pop from an empty queue")
        return best_score, best_entry

    def age(self, now: float) -> None:
        """Move the requests that have waited max_wait to the aged FIFO, oldest first."""
        self.now = now
        max_wait = self.cfg.max_wait
        heap, entries = self._by_arrival, self._entries
        # The waited time as the policy reads it (`now - arrival >= max_wait`): the horizon
        # `arrival <= now - max_wait` rounds otherwise for some times and would leave a request
        # the policy holds aged among the scored ones.
        while heap and now - heap[0][0] >= max_wait:
            _, seq, request_id = heapq.heappop(heap)
            entry = entries.get(request_id)
            if entry is not None and entry.seq == seq:
                self._aged.append(self._kill(entry))
        if len(heap) > 2 * len(entries) + 64:
            self._by_arrival = [item for item in heap
                                if (e := entries.get(item[2])) is not None and e.seq == item[1]]
            heapq.heapify(self._by_arrival)

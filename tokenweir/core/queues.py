"""Waiting queues and the scheduling policies that choose them.

A policy is a small class: the waiting queue it orders by, which running request to preempt
when KV blocks or sequence slots run out, and whether a waiting request may preempt a running
one. The scheduler loop only talks to this interface, so a new policy is a new class here.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from tokenweir.request import Request


class RequestQueue(ABC):
    """Waiting requests in the order the policy admits them."""

    @abstractmethod
    def add(self, request: Request) -> None: ...

    @abstractmethod
    def push_front(self, request: Request) -> None:
        """Put back a request that should not lose its turn: one just preempted, or one that was
        popped but could not be admitted this step."""

    @abstractmethod
    def pop(self) -> Request: ...

    @abstractmethod
    def remove(self, request: Request) -> None: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """All waiting requests, in no guaranteed order."""


class FCFSQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def push_front(self, request: Request) -> None:
        self._queue.appendleft(request)

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)  # O(n), only on abort

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class KeyedQueue(RequestQueue):
    """A heap on `key(request)`; the insertion counter breaks ties and avoids comparing
    requests. The key must not change while the request waits."""

    def __init__(self, key: Callable[[Request], Any]) -> None:
        self._key = key
        self._heap: list[tuple[Any, int, Request]] = []
        self._counter = itertools.count()

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (self._key(request), next(self._counter), request))

    push_front = add  # the key alone decides the order

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def remove(self, request: Request) -> None:
        self._heap = [e for e in self._heap if e[2] is not request]  # O(n), only on abort
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (e[2] for e in self._heap)


class SchedulingPolicy(ABC):
    name: str

    @abstractmethod
    def make_waiting_queue(self) -> RequestQueue: ...

    @abstractmethod
    def select_victim(self, running: list[Request]) -> Request:
        """The running request to preempt when the pool or the sequence slots run out."""

    def may_preempt(self, waiting: Request, victim: Request) -> bool:
        """Whether `waiting` may take the place of the running `victim`."""
        return False

    def begin_step(self, now: float, waiting: RequestQueue, running: list[Request]) -> None:
        """Hook for policies whose order depends on time or load."""


class FCFSPolicy(SchedulingPolicy):
    """Strict arrival order; the most recently admitted request is preempted first."""

    name = "fcfs"

    def make_waiting_queue(self) -> RequestQueue:
        return FCFSQueue()

    def select_victim(self, running: list[Request]) -> Request:
        return running[-1]


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
        return KeyedQueue(priority_key)

    def select_victim(self, running: list[Request]) -> Request:
        return max(running, key=priority_key)

    def may_preempt(self, waiting: Request, victim: Request) -> bool:
        return priority_key(waiting) < priority_key(victim)


POLICIES: dict[str, type[SchedulingPolicy]] = {p.name: p for p in (FCFSPolicy, PriorityPolicy)}


def create_policy(name: str) -> SchedulingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; choose one of {sorted(POLICIES)}") from None

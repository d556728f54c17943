"""Waiting queues: the orders a scheduling policy (core/policies/) admits requests in."""

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

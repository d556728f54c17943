"""Waiting queues: the orders a scheduling policy (core/policies/) admits requests in."""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

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

    def band(self, limit: int) -> Sequence[Request]:
        """Up to `limit` requests the policy ranks alike with the head, the head first, in
        queue order: all an admission order (core/composition.py) may choose among. Empty:
        this queue has no bands, its order is kept."""
        return ()

    def take(self, request: Request) -> None:
        """Take one of `band()`'s requests off the queue, as `pop()` takes the head."""
        raise NotImplementedError(f"{type(self).__name__} has no bands")

    def same_band(self, a: Request, b: Request) -> bool:
        """Whether the policy ranks `a` and `b` alike (either may be running)."""
        return False


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

    def band(self, limit: int) -> Sequence[Request]:
        # FCFS ranks by arrival alone: the whole queue is one band.
        return list(itertools.islice(self._queue, limit))

    def same_band(self, a: Request, b: Request) -> bool:
        return True

    def take(self, request: Request) -> None:
        if self._queue[0] is request:
            self._queue.popleft()
        else:
            self._queue.remove(request)  # within the band's window: near the front


class KeyedQueue(RequestQueue):
    """A heap on `key(request)`; the insertion counter breaks ties and avoids comparing
    requests. The key must not change while the request waits. With `band_key`, requests
    whose band keys are equal form a band (they must be adjacent in key order)."""

    def __init__(self, key: Callable[[Request], Any], band_key: Optional[Callable[[Request], Any]] = None) -> None:
        self._key = key
        self._band_key = band_key
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

    def band(self, limit: int) -> Sequence[Request]:
        if self._band_key is None or not self._heap:
            return ()
        heap, band_key = self._heap, self._band_key
        head = band_key(heap[0][2])
        taken = []
        while heap and len(taken) < limit and band_key(heap[0][2]) == head:
            taken.append(heapq.heappop(heap))
        for entry in taken:  # a pop and a push per entry: O(limit log n), never O(n)
            heapq.heappush(heap, entry)
        return [e[2] for e in taken]

    def same_band(self, a: Request, b: Request) -> bool:
        return self._band_key is not None and self._band_key(a) == self._band_key(b)

    def take(self, request: Request) -> None:
        heap = self._heap
        passed = []
        while heap[0][2] is not request:
            passed.append(heapq.heappop(heap))
        heapq.heappop(heap)
        for entry in passed:
            heapq.heappush(heap, entry)

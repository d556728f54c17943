"""`--max-waiting-requests`: a 429 once that many requests wait, exact under bursts.

A request spends time in the server before the engine counts it (parsing, tokenizing in a
worker thread): checking the engine's count alone let a burst of 64 pass a limit of 4. So the
check and the reservation of a slot happen together, with no `await` between them (the event
loop runs one coroutine at a time), and the slot is held until the engine counts the request.
"""

from __future__ import annotations

from typing import Optional

from tokenweir.engine.client import EngineDeadError
from tokenweir.engine.client import EngineClient
from tokenweir.server.errors import engine_error, overloaded


class WaitingSlot:
    """One reserved place among the waiting requests; `release` is idempotent."""

    def __init__(self, admission: Optional[Admission]) -> None:
        self._admission = admission

    def release(self) -> None:
        if self._admission is not None:
            self._admission.num_reserved -= 1
            self._admission = None


class Admission:
    """Requests reserved in the server plus the engine's waiting count stay within the limit."""

    def __init__(self, client: EngineClient, max_waiting_requests: Optional[int]) -> None:
        if max_waiting_requests is not None and max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
        self.client = client
        self.limit = max_waiting_requests
        self.num_reserved = 0

    def reserve(self) -> WaitingSlot:
        """A slot, or an APIError: 503 when the engine is gone, 429 when the waiting is full.

        The caller releases the slot on every path: on rejection or failure, and on admission
        right before `EngineClient.add_request`, which counts the request in
        `num_waiting_requests()` from its call on (before it first awaits), so the slot passes
        from the server's count to the engine's without a moment counted twice or not at all.
        """
        if not self.client.is_running:
            raise engine_error(EngineDeadError(f"the engine is not running: {self.client.dead_error}"))
        if self.limit is None:
            return WaitingSlot(None)
        if self.client.num_waiting_requests() + self.num_reserved >= self.limit:
            raise overloaded(f"The server is overloaded: {self.limit} requests are already waiting. "
                             "Retry later.")
        self.num_reserved += 1
        return WaitingSlot(self)

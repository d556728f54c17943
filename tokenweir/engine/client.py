"""EngineClient: what the HTTP server needs from an engine, and nothing more.

`AsyncLLMEngine` (one engine in this process) implements it; a multi-replica cluster implements
it too, so the server never depends on which one it serves from or reaches into its internals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterable, Optional, Protocol, Union, runtime_checkable

from prometheus_client import CollectorRegistry

from tokenweir.core.scheduler import SchedulerStats
from tokenweir.engine.output import RequestOutput
from tokenweir.request import SamplingParams, SchedulingHints


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (shut down or crashed); no request can be served."""


class RequestFailedError(RuntimeError):
    """Processing this request failed inside the engine (not the caller's input)."""


class DeadlineExceededError(RequestFailedError):
    """The engine gave up on the request: its deadline passed, or by the step cost model cannot
    be met (overload shedding, sla's drop_expired and drop_unmeetable). The message says when,
    or what it needs and what was left."""


@dataclass(frozen=True)
class ModelInfo:
    """What a client may learn about the served model (never a local path)."""

    name: str
    max_model_len: int  # the longest request (prompt + output) the engine accepts
    vocab_size: int
    # SamplingParams fields a request that leaves them unset gets (the model's
    # generation_config.json under --generation-config auto); the rest: SamplingParams' own.
    default_sampling_params: dict[str, float] = field(default_factory=dict)


class OutputStream(Protocol):
    """A request's cumulative outputs; `aclose()` before the final one aborts the request."""

    def __aiter__(self) -> AsyncIterator[RequestOutput]: ...

    async def __anext__(self) -> RequestOutput: ...

    async def aclose(self) -> None: ...


@runtime_checkable
class EngineClient(Protocol):
    @property
    def model_info(self) -> ModelInfo: ...

    @property
    def tokenizer(self) -> Any:
        """A tokenizer the caller's threads may use (encode, decode, apply_chat_template)."""

    @property
    def is_running(self) -> bool: ...

    @property
    def dead_error(self) -> Optional[BaseException]:
        """Why the engine stopped, or None while it runs."""

    @property
    def metrics_registry(self) -> CollectorRegistry: ...

    def reserve_tenant_labels(self, tenants: Iterable[str]) -> None:
        """Give each of these tenants (the operator's: a keys file's) a metric label of its own,
        whatever other tenants clients name first."""

    def num_waiting_requests(self) -> int:
        """Requests accepted but not running yet (including those still on their way in)."""

    def stalled_seconds(self) -> Optional[float]:
        """Seconds the engine has made no progress while it had work; None while it has none,
        or where the engine watches for hangs itself (a cluster fails its hung replicas over)."""

    async def add_request(self, request_id: str, prompt: Union[str, list[int]], params: SamplingParams,
                          hints: SchedulingHints = SchedulingHints(), *,
                          prompt_text: Optional[str] = None) -> OutputStream:
        """Queue a request once the engine accepted it; returns its cumulative outputs.
        Raises ValueError for bad input; closing the outputs early aborts the request."""

    def abort(self, request_id: str) -> None:
        """Abort a request; unknown or finished ids are ignored."""

    def get_stats(self) -> SchedulerStats: ...

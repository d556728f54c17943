"""Per-step limits: how many tokens a step may compute and how many requests may run.

The scheduler asks its controller for the limits of every step instead of reading two numbers
from its config, so a controller can vary them (an SLO-driven one grows or shrinks the batch)
without touching the scheduler loop. `static` is vLLM's behaviour: the configured numbers.
A controller that adapts also sees what every step did (`on_step`, a `StepObservation`; a
policy that overrides `on_step_observed` is handed the same one); time and measurements enter
only as arguments, so the simulator runs it unchanged.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import TYPE_CHECKING, Any, ClassVar, Optional

from tokenweir.checks import is_integer
from tokenweir.core.cost_model import StepComposition, StepCostModel

if TYPE_CHECKING:
    from tokenweir.core.scheduler import RequestUpdate, SchedulerOutput
    from tokenweir.request import Request


@dataclass(frozen=True, slots=True)
class StepLimits:
    max_num_batched_tokens: int  # the step's token budget
    max_num_seqs: int  # requests that may be running after the step is scheduled

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not is_integer(value) or value < 1:
                raise ValueError(f"step limit {name} must be an integer >= 1, got {value!r}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"step limits: max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                             f">= max_num_seqs ({self.max_num_seqs})")


@dataclass(frozen=True, slots=True)
class StepObservation:
    """What one step did, as the scheduler saw it when the step's results came back at `now`."""

    now: float
    # The step's composition, exact, as the scheduler tallied it (StepTally): its prefill
    # chunks (tokens, rows, causal query-key pairs), its decode rows with their own context,
    # and the bytes of its swap copies (the runner makes them inside the step's time).
    composition: StepComposition
    num_itl_rows: int  # requests that received a token after their first: each waited one ITL
    ttfts: Sequence[float]  # seconds from arrival, of the requests whose first token came now
    num_running: int
    num_waiting: int
    running_context_tokens: int  # computed tokens of the running requests, after the step
    kv_cache_usage: float  # 0..1
    # Seconds per output token after the first (TPOT), of the requests that finished now.
    tpots: Sequence[float] = ()
    # Every running request with output tokens got one now (its last_token_time is `now`): a
    # controller may bound their next due times by it without a pass over them.
    last_tokens_now: bool = False


_num_computed_tokens = attrgetter("num_computed_tokens")


def observe_step(out: SchedulerOutput, composition: StepComposition, updates: Sequence[RequestUpdate],
                 finished: Sequence[Request], running: Sequence[Request], num_waiting: int, kv_cache_usage: float,
                 now: float, first_tokens: Sequence[Request], num_dropped: int, num_unsampled: int) -> StepObservation:
    """`composition`: what the step computed, as the scheduler tallied it while building the
    step (StepTally: its prefill chunks exactly, its decode rows with their own context), with
    its swap copies;
    `finished`: the requests the step finished; `first_tokens`: those whose first token came
    now; `num_dropped`: how many requests it scheduled were aborted before its results came
    back; `num_unsampled`: how many with output tokens it scheduled a chunk of that sampled
    nothing (computing their context again after a recompute preemption)."""
    scheduled = out.num_scheduled_tokens
    ttfts = [now - r.arrival_time for r in first_tokens]
    num_itl = len(updates) - len(ttfts)
    tpots = [(now - r.first_token_time) / (n - 1) for r in finished if (n := len(r.output_token_ids)) > 1]
    # Steady decode (every running request decoded, none finished): the decode rows are the
    # running requests, their context after the step the decode rows' context.
    steady = not out.prefill_num_computed_tokens and len(updates) == len(running) == len(scheduled)
    running_context = (composition.decode_context_tokens if steady
                       else sum(map(_num_computed_tokens, running)))
    # The scheduled requests still running are those neither finished nor dropped; the running
    # ones all ran if there are as many of them (a running request the step left out, its
    # budget spent, has its last token from an earlier step), and each with outputs sampled
    # unless a recompute chunk stopped short of its context.
    last_tokens_now = not num_unsampled and len(running) == len(scheduled) - len(finished) - num_dropped
    return StepObservation(now, composition, num_itl, ttfts, len(running), num_waiting, running_context,
                           kv_cache_usage, tpots, last_tokens_now)


class BatchController(ABC):
    """Chooses each step's limits. Time and measurements enter only as arguments."""

    name: ClassVar[str] = ""
    config_class: ClassVar[Optional[type]] = None  # its knobs (a dataclass); None: it has none

    @classmethod
    def from_config(cls, config: Any, limits: StepLimits, cost_model: Optional[StepCostModel],
                    watermark: float) -> BatchController:
        """Built by the registry (`core/batch_controllers.py`) within `limits`, the configured
        maxima; `cost_model` may be None (the scheduler has none)."""
        raise NotImplementedError(f"batch controller {cls.__name__} cannot be built by name")

    @abstractmethod
    def get_limits(self, now: float) -> StepLimits:
        """The limits of the step being scheduled; never above the configured maxima. A lower
        sequence cap holds back admissions: running requests are never preempted to bring the
        batch down to it. It holds as the configured cap does: at a full cap a preempting
        policy may let a request displace one running request for its slot (more only if its
        blocks need them), never grow the batch past it."""

    def begin_step(self, now: float, running: Sequence[Request]) -> None:
        """A step is about to be scheduled at `now` with these requests running (before
        get_limits). Called only of a controller that overrides this: it costs a pass over them."""

    def cut_chunk(self, num_tokens: int, num_computed: int, total_tokens: int, num_prompt_tokens: int,
                  step: StepComposition, pending_rows: int) -> int:
        """How many of a prefill chunk's `num_tokens` (after `num_computed` of its request's
        `total_tokens`) the step may compute, 0 to `num_tokens` (0: none this step). `step`: what
        the step holds so far; `pending_rows`: running requests the scheduler has yet to visit
        this step (decode rows, most of them). Asked for every prefill chunk, after the budget
        and the long-prefill threshold cut it, only of a controller that overrides this."""
        return num_tokens

    def on_step(self, observation: StepObservation) -> None:
        """A step's results came back (not called for a failed step). The scheduler builds the
        observation only for a controller that overrides this."""

    def get_stats(self) -> dict[str, object]:
        """The controller's state for SchedulerStats.batch_control (kept small: read after
        every step)."""
        return {}


class StaticBatchController(BatchController):
    name = "static"

    def __init__(self, limits: StepLimits) -> None:
        self.limits = limits

    @classmethod
    def from_config(cls, config: None, limits: StepLimits, cost_model: Optional[StepCostModel],
                    watermark: float) -> StaticBatchController:
        return cls(limits)

    def get_limits(self, now: float) -> StepLimits:
        return self.limits

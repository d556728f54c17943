"""Per-step limits: how many tokens a step may compute and how many requests may run.

The scheduler asks its controller for the limits of every step instead of reading two numbers
from its config, so a controller can vary them (an SLO-driven one grows or shrinks the batch)
without touching the scheduler loop. `static` is vLLM's behaviour: the configured numbers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from tokenweir.checks import is_integer


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


class BatchController(ABC):
    """Chooses each step's limits. Time and measurements enter only as arguments."""

    @abstractmethod
    def get_limits(self, now: float) -> StepLimits:
        """The limits of the step being scheduled; never above the configured maxima. A lower
        sequence cap only holds back admissions: running requests are never preempted for it."""


class StaticBatchController(BatchController):
    def __init__(self, limits: StepLimits) -> None:
        self.limits = limits

    def get_limits(self, now: float) -> StepLimits:
        return self.limits

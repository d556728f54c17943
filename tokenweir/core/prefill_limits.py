"""Concurrent partial prefills: how many prefills a step may leave unfinished, and how many long
ones it may run (vLLM's `max_num_partial_prefills`, `max_long_partial_prefills`).

A request prefills in a step when it has more than one token left to compute (one is a decode);
its prefill is partial when the step leaves some of them for later, and long while more than
`long_prefill_token_threshold` are left (so a long prompt turns short for its last chunk and
frees its long slot then). At most `max_num_partial_prefills` prefills end a step unfinished: a
short prompt done in one step takes no slot, only budget. At most `max_long_partial_prefills`
long ones run in a step. Running requests are never held back: the limits act on admissions
(and swap-ins), so they hold for the running requests too.

Short prompts may pass a long one that waits for a long slot (it keeps its place in line and
starts as soon as a slot is free: running prefills end, so it cannot starve), but only where the
policy allows (`SchedulingPolicy.may_overtake`): never past a request ranked first for its
priority or deadline.

The budget: the threshold caps a long prefill's first claim on the step, not its share. What
the step has left after admissions goes back to the capped prefills (`Scheduler._top_up`), so short
prompts arriving behind a long one get in at once, and the long one still fills an otherwise
idle step (a hard cap, vLLM's, leaves budget unused whenever nothing short is waiting).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from tokenweir.config import SchedulerConfig
from tokenweir.core.policies import SchedulingPolicy
from tokenweir.request import Request

# How many requests waiting for a long slot admission looks past in one step: the scan must not
# grow with the queue (a step's cost stays flat at 10,000 waiting); a short prompt behind more
# of them waits until they have started.
MAX_PASSED_PER_STEP = 16


@dataclass(frozen=True, slots=True)
class PartialPrefillLimits:
    max_num_partial_prefills: int
    max_long_partial_prefills: int
    long_prefill_token_threshold: int

    @classmethod
    def from_config(cls, config: SchedulerConfig) -> Optional[PartialPrefillLimits]:
        """The limits, or None when they are off (max_num_partial_prefills 1, vLLM's default)."""
        if config.max_num_partial_prefills == 1:
            return None
        if not config.long_prefill_token_threshold:
            raise ValueError(f"max_num_partial_prefills ({config.max_num_partial_prefills}) > 1 needs a "
                             "long_prefill_token_threshold, or a max_model_len to derive it from (4%)")
        return cls(config.max_num_partial_prefills, config.max_long_partial_prefills,
                   config.long_prefill_token_threshold)

    def begin_step(self, policy: SchedulingPolicy, now: float) -> StepPrefills:
        return StepPrefills(self, policy, now)


@dataclass(slots=True)
class StepPrefills:
    """The prefills of the step being built. The scheduler reports every chunk it schedules
    (`add`) and every victim it preempts (`remove`), and asks before each admission (`admits`)."""

    limits: PartialPrefillLimits
    policy: SchedulingPolicy
    now: float
    # Request id -> (long, partial) of each prefill scheduled in this step.
    prefills: dict[str, tuple[bool, bool]] = field(default_factory=dict)
    num_long: int = 0
    num_partial: int = 0
    passed: list[Request] = field(default_factory=list)  # waiting for a long slot, in policy order

    def add(self, request: Request, num_scheduled: int) -> None:
        """Count a scheduled chunk (before its tokens are computed), or a chunk grown since."""
        num_left = request.num_tokens - request.num_computed_tokens
        if num_left > 1:
            self.remove(request.request_id)
            kind = (num_left > self.limits.long_prefill_token_threshold, num_scheduled < num_left)
            self.prefills[request.request_id] = kind
            self.num_long += kind[0]
            self.num_partial += kind[1]

    def remove(self, request_id: str) -> None:
        """A victim preempted in this step gives its slots back."""
        kind = self.prefills.pop(request_id, None)
        if kind is not None:
            self.num_long -= kind[0]
            self.num_partial -= kind[1]

    def admits(self, request: Request, num_new_tokens: int, budget: int) -> bool:
        """Whether `request`, with `num_new_tokens` to compute (prefix hits excluded), may start
        now, in a step with `budget` tokens left. A long one refused only for want of a long
        slot is `passed` over: shorter ones behind it may still start, where the policy lets
        them overtake every such request."""
        if not all(self.policy.may_overtake(request, ahead, self.now) for ahead in self.passed):
            return False
        if num_new_tokens <= 1:
            return True
        is_long = num_new_tokens > self.limits.long_prefill_token_threshold
        if (is_long or num_new_tokens > budget) and self.num_partial >= self.limits.max_num_partial_prefills:
            return False
        if is_long and self.num_long >= self.limits.max_long_partial_prefills:
            if len(self.passed) < MAX_PASSED_PER_STEP:
                self.passed.append(request)
            return False
        return True

    def was_passed(self, request: Request) -> bool:
        """Whether admission refused `request` only to look past it (see `admits`)."""
        return bool(self.passed) and self.passed[-1] is request

    def capped(self) -> list[str]:
        """The long prefills of this step, in the order they were scheduled: the ones the
        threshold capped, which the step's leftover budget tops up."""
        return [rid for rid, (is_long, _) in self.prefills.items() if is_long]

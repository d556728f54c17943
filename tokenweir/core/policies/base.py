"""The interface between the scheduler loop and a scheduling policy.

A policy is a small class built from its own config dataclass: it makes the waiting queue (the
admission order), picks the running request to preempt, decides whether a waiting request may
displace a running one and how far admission may look past a request that cannot run now, and
sees what every step served and when its results came back. Every call gets `now`: the
scheduler never reads a clock, so the simulator and the engine make the same decisions.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Optional

from tokenweir.core.batch_control import StepObservation
from tokenweir.core.cost_model import RemainingWork, StepTally
from tokenweir.core.queues import RequestQueue
from tokenweir.request import Request


@dataclass(frozen=True)
class PolicyConfig:
    """Knobs of a policy (subclass it; every field needs a documented default)."""


@dataclass(slots=True)
class ServedRequest:
    """What one step did for one request: the feedback a fair-share policy charges."""

    request: Request
    num_computed_tokens: int  # prompt or output tokens whose K/V this step computed
    num_recomputed_tokens: int  # of those, tokens computed before and lost to a preemption
    num_output_tokens: int  # tokens sampled for it this step


ServedRow = tuple[Request, int, int, int]  # the fields of a ServedRequest, in order
_PLAIN_DECODE = (1, 0, 1)  # a plain decode row's computed, recomputed and output tokens


@dataclass(slots=True)
class StepServed(Sequence[ServedRequest]):
    """What the scheduler hands `on_step_served`: the ServedRequest fields of one step, a column
    each. A record object per scheduled request per step, most of them alive at once, costs
    more than the policies' use of it (and pushes the garbage collector into full passes over
    the waiting queue); the built-in policies read the columns (`served_parts`), records are
    built on access. A plain decode row (one token computed, none recomputed, one sampled: most
    rows of most steps) is only its request, in `decode_requests`, after the other rows."""

    requests: list[Request] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    num_recomputed_tokens: list[int] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)
    decode_requests: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # the served requests the step finished

    def __len__(self) -> int:
        return len(self.requests) + len(self.decode_requests)

    def __getitem__(self, index: int) -> ServedRequest:  # type: ignore[override]
        if index < 0:
            index += len(self)
        num_other = len(self.requests)
        if 0 <= index < num_other:
            return ServedRequest(self.requests[index], self.num_computed_tokens[index],
                                 self.num_recomputed_tokens[index], self.num_output_tokens[index])
        return ServedRequest(self.decode_requests[index - num_other], *_PLAIN_DECODE)

    def __iter__(self) -> Iterator[ServedRequest]:
        return (ServedRequest(*row) for row in self.rows())

    def other_rows(self) -> Iterator[ServedRow]:
        """The rows that are not plain decode rows."""
        return zip(self.requests, self.num_computed_tokens, self.num_recomputed_tokens, self.num_output_tokens)

    def rows(self) -> Iterator[ServedRow]:
        return itertools.chain(self.other_rows(), ((r, *_PLAIN_DECODE) for r in self.decode_requests))


def served_rows(served: Sequence[ServedRequest]) -> Iterable[ServedRow]:
    """The rows of a step's feedback, whether the scheduler's columns or a list of records."""
    if isinstance(served, StepServed):
        return served.rows()
    return ((s.request, s.num_computed_tokens, s.num_recomputed_tokens, s.num_output_tokens) for s in served)


def served_parts(served: Sequence[ServedRequest]) -> tuple[Iterable[ServedRow], Sequence[Request], Sequence[Request]]:
    """A step's feedback in three parts: the rows that are not plain decode rows, the requests
    of the plain decode rows (each one token computed, none recomputed, one sampled: a policy
    may count them by attribute in one C-level pass), and the requests the step finished."""
    if isinstance(served, StepServed):
        return served.other_rows(), served.decode_requests, served.finished
    rows = list(served_rows(served))
    decode = [row[0] for row in rows if row[1:] == _PLAIN_DECODE]
    return ([row for row in rows if row[1:] != _PLAIN_DECODE], decode,
            [row[0] for row in rows if row[0].finished_time is not None])


class SchedulingPolicy(ABC):
    name: ClassVar[str]
    config_class: ClassVar[type[PolicyConfig]] = PolicyConfig

    def __init__(self, config: PolicyConfig | None = None) -> None:
        config = self.config_class() if config is None else config
        if type(config) is not self.config_class:
            raise ValueError(f"policy {self.name!r} takes a {self.config_class.__name__}, "
                             f"got {type(config).__name__}")
        self.config = config

    @abstractmethod
    def make_waiting_queue(self) -> RequestQueue: ...

    @abstractmethod
    def select_victim(self, running: Sequence[Request], now: float) -> Request:
        """The request among `running` (never empty) to preempt first."""

    def may_preempt(self, waiting: Request, victim: Request, now: float) -> bool:
        """Whether `waiting` may take the place of the running `victim`."""
        return False

    def head_may_preempt(self, waiting: RequestQueue, now: float) -> bool:
        """With every sequence slot taken (so the next waiting request gets in only by
        preempting a running one), whether it might: False lets the scheduler end the step's
        admissions without taking it off the queue. Only a proof may say False; by default
        it is tried (True)."""
        return True

    def admission_lookahead(self) -> int:
        """How many waiting requests admission may pass over, in one step, when the one whose
        turn it is cannot be admitted now (it stays first in line). 0 keeps strict order:
        head-of-line blocking, so a large request is never overtaken forever."""
        return 0

    def may_overtake(self, request: Request, ahead: Request, now: float) -> bool:
        """Whether `request` may start before `ahead`, which the policy ranks first but which
        must wait for a reason of batch composition (no long-prefill slot this step). Only if
        the policy ranks `ahead` first for nothing a reordering would defeat (priority,
        deadline, fair share): by default never, so a policy keeps strict order unless it says."""
        return False

    def may_admit(self, request: Request, num_new_tokens: int, num_computed_tokens: int,
                  step: StepTally, now: float) -> bool:
        """Whether `request` (waiting or swapped out), which the scheduler could start now with a
        chunk of `num_new_tokens` after `num_computed_tokens`, may join this step; `step` is the
        composition of what the step schedules so far (for the running list begin_step was
        given, as the scheduler fills it; read-only). False holds it back, and ends this step's
        admissions (for a swapped-out request: its swap-ins). By default always."""
        return True

    def begin_step(self, now: float, waiting: RequestQueue, running: Sequence[Request]) -> None:
        """Called once per step before anything is scheduled: re-score what depends on time."""

    def end_step(self, now: float) -> None:
        """Called once the step is scheduled (before it runs): drop what held only while it
        was being built."""

    def on_step_served(self, served: Sequence[ServedRequest], now: float) -> None:
        """Called once per step after its results are applied, with every scheduled request
        (from the scheduler, a StepServed: read it with `served_rows` or `served_parts`)."""

    def on_step_observed(self, observation: StepObservation) -> None:
        """Called once per step after its results are applied (not for a failed step), with
        what the step did and `observation.now`, when its results came back: the same
        StepObservation the batch controller's `on_step` gets. The scheduler builds it (a pass
        over the step) only if the policy or the controller overrides its hook."""

    def take_expired(self, now: float,
                     least_work: Callable[[Request], RemainingWork]) -> Sequence[tuple[Request, str]]:
        """Called once per step before anything is scheduled: requests (waiting or running) the
        policy gives up on, each with why; the scheduler finishes them as aborted. `least_work`
        is the scheduler's `least_remaining_work`: the least an unfinished request still needs
        (its prefix-cache hit counted), for a policy that judges whether it can still finish."""
        return ()

    def explain_request(self, request: Request, now: float) -> Optional[dict[str, object]]:
        """The terms of the policy's rank of an unfinished `request` (waiting, running or swapped
        out) at `now`, by name, as of the latest begin_step's state, in a new dict; read-only
        (for debugging and stats: it changes no decision). None for a policy that ranks by no
        score (default)."""
        return None

    def get_stats(self) -> dict[str, object]:
        """The policy's state for SchedulerStats (kept small: it is read after every step)."""
        return {}

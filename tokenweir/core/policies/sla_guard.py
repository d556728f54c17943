"""The SLO guard of `sla`: no less important prefill in a step that would make a more important
request miss its SLO.

A step's time grows with every prefill chunk in it (on CPU a 300-token chunk takes several
decode steps' time), and every request scheduled in the step waits for its end. The queue order
puts the most important requests first, but once they are in, strict priority fills the rest of
the budget with less important prefills: a step of interactive decodes and prefills then also
carries batch prompts, and the interactive requests' first tokens and token pace wait for them.
So, before a waiting (or swapped-out) request of class c is let into the step, the guard
predicts the step's time without it (t0) and with it (t1) by the cost model, scaled by the
running ratio of measured to predicted step periods (core/step_timing.py, as `slo` batch
control does: the profile may be of another machine; the policy feeds it each step's
StepObservation), and refuses it if
a request of a more important class scheduled in the step is *protected*:
- before its first token, with a TTFT SLO: on time without the chunk (now + t0 <= arrival +
  ttft_slo) and late with it (now + t1 > arrival + ttft_slo);
- decoding, with a TPOT SLO: its mean TPOT would exceed the SLO with the next token
  (now + t1 > first_token + tpot_slo * num_output_tokens, the mean kept at every token, so it
  holds however early the request stops), while the SLO can still be met: the rest of its
  max_tokens at the decode-only step time (t_dec, the step's decode rows alone) ends by
  first_token + tpot_slo * (max_tokens - 1). A request that is behind but can still catch up
  (decode steps shorter than its TPOT SLO bank time) is protected; a hopeless one is not.
A refusal ends the step's admissions (the queue's order is the policy's: what follows is no
more important). A request that has waited max_wait passes the guard (the wait bound), and
nothing is refused while no more important request runs, so a less important request waits at
most until the more important ones have slack, or max_wait.

The step is seen as the scheduler builds it: its composition so far (the scheduler's
StepTally, kept as it schedules), the running list (the scheduler's own, read live) for the
requests to protect, and the candidate's chunk as it would be admitted (after its prefix-cache
hit and the budget's cap). The scheduler asks only once the request could be admitted (blocks,
slot), so a full batch costs nothing here; the victims an admission would preempt still count
in t1 (it errs towards refusing).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

from tokenweir.core.batch_control import StepObservation
from tokenweir.core.cost_model import StepCostModel, StepTally, chunk_composition
from tokenweir.core.policies.sla_score import priority_class
from tokenweir.core.step_timing import StepTimeCorrection
from tokenweir.request import Request

logger = logging.getLogger("tokenweir.sla")


@dataclass(slots=True)
class _Protectable:
    """The running requests with a TTFT or TPOT SLO, by priority class, as the step fills."""

    by_class: list[list[Request]]
    # Per class, the earliest time by which a chunk's step must end for none of them to be
    # refused for: a request waiting for its first token, its TTFT due time; one decoding, the
    # time its next token keeps its mean TPOT (first token + tpot_slo x tokens so far). A step
    # predicted to end by then refuses nobody, without a look at each.
    earliest_by_class: list[float]
    counted: int = 0  # running[:counted] are sorted in
    last: Optional[Request] = None  # running[counted - 1] when counted: a victim's removal moves it
    min_class: int = 1 << 31  # the most important class among them


class SLOGuard:
    """Decides, admission by admission, whether a request's prefill may join the step."""

    def __init__(self, cost_model: StepCostModel, num_classes: int) -> None:
        # Predictions of the cost model times measured / predicted (1 until `observe` is fed).
        self.timing = StepTimeCorrection(cost_model)
        self.num_classes = num_classes
        self.now = 0.0
        self._running: Sequence[Request] = ()
        self._view: Optional[_Protectable] = None
        self.num_refused = 0  # admissions held back, cumulative
        self.last_refusal: Optional[tuple[str, str, str]] = None  # (held back, protected, which SLO)

    def begin_step(self, now: float, running: Sequence[Request]) -> None:
        self.now = now
        self._running = running
        self._view = None
        self.timing.begin_step(now)

    def observe(self, observation: StepObservation) -> None:
        """A step's results came back: its measured period corrects the predictions."""
        self.timing.observe(observation)

    def _protectable(self) -> _Protectable:
        """The running requests with an SLO, updated for the requests admitted since the last
        call; re-sorted when a victim left the running list (its length, or the request at the
        counted end, changed: a one-for-one preemption keeps the length)."""
        running, view = self._running, self._view
        n = self.num_classes
        if (view is None or len(running) < view.counted
                or (view.counted and running[view.counted - 1] is not view.last)):
            view = self._view = _Protectable([[] for _ in range(n)], [math.inf] * n)
        by_class, earliest, min_class = view.by_class, view.earliest_by_class, view.min_class
        for r in running[view.counted:]:  # every running request once per step: kept lean
            h = r.hints
            if h.ttft_slo is not None or h.tpot_slo is not None:
                p = h.priority  # priority_class, inlined
                cls = 0 if p <= 0 else (p if p < n else n - 1)
                by_class[cls].append(r)
                if cls < min_class:
                    min_class = cls
                first = r.first_token_time
                if first is None:
                    if h.ttft_slo is not None and r.arrival_time + h.ttft_slo < earliest[cls]:
                        earliest[cls] = r.arrival_time + h.ttft_slo
                elif h.tpot_slo is not None:
                    due = first + h.tpot_slo * len(r.output_token_ids)
                    if due < earliest[cls]:
                        earliest[cls] = due
        view.min_class = min_class
        view.counted = len(running)
        view.last = running[-1] if running else None
        return view

    def admits(self, request: Request, num_new_tokens: int, num_computed_tokens: int, step: StepTally) -> bool:
        """Whether `request`, next in the policy's order, may start in this step with a chunk of
        `num_new_tokens` after `num_computed_tokens`; `step` is what the step schedules so far."""
        cls = priority_class(request.priority, self.num_classes)
        if cls == 0:
            return True  # nothing is more important
        view = self._protectable()
        if view.min_class >= cls:
            return True
        predict, now = self.timing.predict, self.now
        before = step.composition()
        t0 = predict(before)
        t1 = predict(before + chunk_composition(num_new_tokens, num_computed_tokens, request.num_tokens,
                                                request.num_prompt_tokens))
        if now + t1 <= min(view.earliest_by_class[view.min_class:cls]):
            return True  # the step ends in time for every one of them (see _Protectable)
        t_dec: Optional[float] = None
        for r in (r for c in range(view.min_class, cls) for r in view.by_class[c]):
            h = r.hints
            if r.first_token_time is None:
                if h.ttft_slo is None:
                    continue
                due = r.arrival_time + h.ttft_slo
                if now + t1 > due >= now + t0:
                    return self._refuse(request, r, "TTFT")
            elif h.tpot_slo is not None:
                n = r.num_output_tokens
                if now + t1 <= r.first_token_time + h.tpot_slo * n:
                    continue
                max_tokens = r.sampling_params.max_tokens
                if max_tokens is None:
                    if now + t0 > r.first_token_time + h.tpot_slo * n:
                        continue  # behind already, and no end to catch up by
                else:
                    if t_dec is None:
                        t_dec = predict(step.decodes())
                    if now + t0 + (max_tokens - n - 1) * t_dec > r.first_token_time + h.tpot_slo * (max_tokens - 1):
                        continue  # cannot meet its TPOT SLO any more
                return self._refuse(request, r, "TPOT")
        return True

    def _refuse(self, request: Request, protected: Request, slo: str) -> bool:
        self.num_refused += 1
        self.last_refusal = (request.request_id, protected.request_id, slo)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("sla t=%.3f holds back %s: %s would miss its %s SLO", self.now, request.request_id,
                         protected.request_id, slo)
        return False

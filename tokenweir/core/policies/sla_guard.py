"""The SLO guard of `sla`: no less important prefill in a step that would make a more important
request miss its SLO.

A step's time grows with every prefill chunk in it (on CPU a 300-token chunk takes several
decode steps' time), and every request scheduled in the step waits for its end. The queue order
puts the most important requests first, but once they are in, strict priority fills the rest of
the budget with less important prefills: a step of interactive decodes and prefills then also
carries batch prompts, and the interactive requests' first tokens and token pace wait for them.
So, before a waiting (or swapped-out) request of class c is let into the step, the guard
predicts the step's time without it (t0) and with it (t1) by the cost model, and refuses it if
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

The step is seen as the scheduler builds it: the running list (the scheduler's own, read
live), every request in it computing all its remaining tokens, the candidate all of its prompt.
The budget's cap on chunks and prefix-cache hits are not known here; both can only make the
prediction longer, so the guard errs towards protecting.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

from tokenweir.core.cost_model import StepComposition, StepCostModel, chunk_composition
from tokenweir.core.policies.sla_score import priority_class
from tokenweir.request import Request, RequestStatus

logger = logging.getLogger("tokenweir.sla")


@dataclass(slots=True)
class _StepView:
    counted: int = 0  # running[:counted] are in the sums below
    composition: StepComposition = StepComposition()
    decodes: StepComposition = StepComposition()  # the decode rows alone
    # (class, request) of running requests with a TTFT or TPOT SLO
    with_slo: list[tuple[int, Request]] = field(default_factory=list)
    min_class: int = 1 << 31  # the most important class among them


class SLOGuard:
    """Decides, admission by admission, whether a request's prefill may join the step."""

    def __init__(self, cost_model: StepCostModel, num_classes: int) -> None:
        self.cost_model = cost_model
        self.num_classes = num_classes
        self.now = 0.0
        self._running: Sequence[Request] = ()
        self._view: Optional[_StepView] = None
        self.num_refused = 0  # admissions held back, cumulative
        self.last_refusal: Optional[tuple[str, str, str]] = None  # (held back, protected, which SLO)

    def begin_step(self, now: float, running: Sequence[Request]) -> None:
        self.now = now
        self._running = running
        self._view = None

    def _step_view(self) -> _StepView:
        """The step so far, updated for the requests admitted since the last call (recounted
        when one left the running list: a victim)."""
        running, view = self._running, self._view
        if view is None or len(running) < view.counted:
            view = self._view = _StepView()
        for r in running[view.counted:]:
            if r.status != RequestStatus.RUNNING:
                continue
            chunk = chunk_composition(r.num_tokens - r.num_computed_tokens, r.num_computed_tokens,
                                      r.num_tokens, r.num_prompt_tokens)
            view.composition += chunk
            if chunk.num_decode_seqs:
                view.decodes += chunk
            h = r.hints
            if h.ttft_slo is not None or h.tpot_slo is not None:
                cls = priority_class(r.priority, self.num_classes)
                view.with_slo.append((cls, r))
                if cls < view.min_class:
                    view.min_class = cls
        view.counted = len(running)
        return view

    def admits(self, request: Request) -> bool:
        """Whether `request`, next in the policy's order, may start in this step."""
        cls = priority_class(request.priority, self.num_classes)
        if cls == 0:
            return True  # nothing is more important
        view = self._step_view()
        if view.min_class >= cls:
            return True
        predict, now = self.cost_model.predict, self.now
        t0 = predict(view.composition)
        t1 = predict(view.composition + chunk_composition(
            request.num_tokens - request.num_computed_tokens, request.num_computed_tokens,
            request.num_tokens, request.num_prompt_tokens))
        t_dec: Optional[float] = None
        for c, r in view.with_slo:
            if c >= cls:
                continue
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
                        t_dec = predict(view.decodes)
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

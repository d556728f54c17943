"""Step times predicted by a cost model, corrected by the step times measured.

A profile is of one machine, at one load: on a faster or slower machine (a GPU against the
shipped CPU profile), or a busier one, every prediction is off by about the same factor. So a
bounded running ratio of measured to predicted step periods scales the predictions; both the
`slo` batch controller (batch_slo.py) and sla's SLO guard (policies/sla_guard.py) predict
through one. It corrects the scale only: a profile whose shape is wrong (how a prefill chunk
weighs against a decode row) stays wrong in shape.

A step's period is timed from the previous step's results when decode rows waited for it (their
inter-token latency: the scheduler's own time between the steps included), else from the
step's own start (a step after idle time, or of first tokens only); the ratio learns from the
step's own time when a step failed before it (its rows waited for both). Time enters only as
arguments: `begin_step(now)` at `schedule(now)`, and the `now` of the StepObservation, when
the step's results came back.
"""

from __future__ import annotations

from collections import deque
from typing import Optional

from tokenweir.core.batch_control import StepObservation
from tokenweir.core.cost_model import StepComposition, StepCostModel

# Weight of one step in the measured/predicted ratio: about ten steps of memory, so one noisy
# step moves the predictions by a tenth of its error.
CORRECTION_GAIN = 0.1
# One step's ratio is taken within this factor of the running one: an outlier moves it little,
# yet it reaches any scale (a GPU against the shipped CPU profile) within some steps.
MAX_STEP_FACTOR = 10.0
# `low_ratio` is the smallest ratio of this many recent steps (and the running one).
LOW_RATIO_STEPS = 32
# ... and None until this many steps were measured. A bound that sheds on it must not trust a
# fresh engine's first steps alone: they may be a warm-up (first forward passes of each kernel
# path, the allocator growing) many times slower than the rest, and judged by them a request
# that could finish is shed (a review's case: 12.7 ms needed, judged 122 ms). The minimum takes
# the first step that is not: the warm-up must last all of the first 8 steps to mislead it. On
# an AMD EPYC CPU (fp32, SmolLM2-135M) none lasted past the first step (a GPU's not measured).
# Waiting costs those steps without unmeetable verdicts (passed deadlines are still shed), once
# per engine: 8 is a few times any warm-up seen, and 32 (the window) costs 4x the time: in
# docs/benchmarks/sla.md (e)'s simulation at x3 (shipped CPU profile, steps of prompt chunks
# taking 1.5 s) the first verdicts came after 9 s of its run, after 46 s with 32.
LOW_RATIO_MIN_STEPS = 8


class StepTimeCorrection:
    """`predict` is the cost model's prediction times `ratio`, measured / predicted so far."""

    def __init__(self, cost_model: StepCostModel) -> None:
        self.cost_model = cost_model
        self.ratio = 1.0
        self._step_start = 0.0
        self._last_end: Optional[float] = None
        self._begun = 0  # steps begun since the last results: more than one, a step failed between
        # The cost model's own prediction of the last observed step (no ratio): measured over it,
        # steps of different shapes compare (a knee the model lacks shows as a higher ratio).
        self.predicted = 0.0
        self._recent: deque[float] = deque(maxlen=LOW_RATIO_STEPS)  # measured / predicted, unbounded

    @property
    def low_ratio(self) -> Optional[float]:
        """The smallest of the running ratio and the last LOW_RATIO_STEPS steps' own ratios; None
        until LOW_RATIO_MIN_STEPS steps were measured (a warm-up must not be all it has seen: see
        there). For a bound that must not overstate step times (sla's unmeetable deadlines): the
        running ratio leaves a profile of a slower machine at a fraction of its excess per step
        (0.91x at most), one step's own ratio tells it at once, and a step shape the profile
        overweights shows here as a low ratio."""
        if len(self._recent) < LOW_RATIO_MIN_STEPS:
            return None
        return min(self.ratio, min(self._recent))

    def begin_step(self, now: float) -> None:
        """The step being scheduled starts at `now`."""
        self._step_start = now
        self._begun += 1

    def observe(self, obs: StepObservation) -> Optional[float]:
        """Takes in a step's results; returns its period if decode rows waited for it (their
        inter-token latency), else None."""
        # No decode row waited (or it is the first step): timed from the step's own start.
        start = self._last_end if obs.num_itl_rows > 0 else None
        period = obs.now - (self._step_start if start is None else start)
        # The ITL includes a failed step before this one (its rows waited for both); what this
        # step cost, which the ratio learns from, is timed from its own start.
        own = period if self._begun <= 1 else obs.now - self._step_start
        self._last_end = obs.now
        self._begun = 0
        predicted = self.cost_model.predict(obs.composition)
        self.predicted = predicted
        if predicted > 0 and own > 0:
            self._recent.append(own / predicted)
            r = self.ratio
            measured = min(MAX_STEP_FACTOR * r, max(r / MAX_STEP_FACTOR, own / predicted))
            self.ratio += CORRECTION_GAIN * (measured - r)
        return None if start is None else period

    def predict(self, comp: StepComposition) -> float:
        return self.ratio * self.cost_model.predict(comp)

"""`slo` batch control: the largest step limits whose inter-token latency stays under a target.

Every decode row of a step waits for the whole step, so the step period is each row's
inter-token latency (ITL), and a request's TPOT is the mean of its ITLs: keeping the windowed
p99 of ITL under `target_tpot_ms` keeps TPOT under it too. Throughput is highest when every
step is as long as the target allows (the per-step cost is paid once for more rows), so:

- predict: the cost model gives the largest sequence cap whose decode rows alone fill the
  target but a reserve (left for prefill chunks, so admitted prompts keep progressing), and the
  largest token budget whose full step (those decode rows plus a prefill chunk) fits the target;
  within the budget each prefill chunk is cut to what the period has left beside the step's
  other work (`cut_chunk`: a chunk deep in a long prompt costs more per token than one at its
  start, which a budget in tokens cannot tell apart);
- correct: a running ratio of measured to predicted step periods (core/step_timing.py, which
  sla's SLO guard shares) scales every prediction (the profile may be of another machine, or
  the machine busier); the windowed p99 of measured ITL scales the target the prediction aims
  at (tails the mean-fitted model does not see): down at once in proportion to a violation, up
  by at most `GROWTH` per window (by `MAX_GROWTH` far under the band while climbing back to the
  model's own aim), and only while a limit actually held something back;
- hysteresis: no feedback inside the band [target x (1 - hysteresis), target x (1 - hysteresis
  / 4)] (its top stays below the target, so noise at the top does not cross it); a limit moves
  only by more than `hysteresis` of itself unless the target is violated; and after the
  feedback moves, the p99 is taken only over the steps since (an old tail must not shrink it
  twice), and it grows again only once those steps span a whole window.

The p99 vouches for growth only as far as the steps it measured reach: growth also asks the p99
of measured over predicted periods, times the period aimed at (what steps filling it would take
at the measured tail). Steps smaller than the limits (a cap full of decode rows, no prompt chunk
among them) measure short, and an aim grown on them alone overshoots as soon as admissions bring
chunks into steps full of rows: the prefill reserve is kept for them.

A knee the cost model's shape lacks (steps of more than some number of sequences costing far
more than predicted) would make the limits cycle: the one correction ratio learns it from the
steps past the knee and shrinks every prediction, under the knee it falls back, and the cap
crosses the knee again. When, among the decode-only steps the p99 covers, every step of the
smallest batch that broke the target or a larger one took at least `KNEE_STEP` more over the
model's own prediction than every smaller one did, the controller remembers that batch
(`broken_num_seqs`, in its stats) and holds the cap under it instead of shrinking the aim. Steps
are compared like with like: those carrying a prompt chunk among themselves, those of decode
rows alone among themselves. A step with a chunk differs from one without by more than its
batch (early on, every larger batch has an admission's chunk in it and every single-row step is
a lone decode), so across the two kinds a profile that undercounts prefill would look like a
knee at two rows and pin the cap at one; and under steady arrivals almost every step carries a
chunk, so the knee must be found among those too. A knee is also a claim about batch size
against time: while a batch grows, its larger batches are its later steps, and a slowdown that
comes then (the machine busy) looks like a knee. So a newly remembered knee must show again
under the held cap: the median of the first `KNEE_CONFIRM_STEPS` steps since the hold (all
under the knee) over the model's prediction must be `KNEE_STEP` under the knee's; if they are as
slow (the slowdown was in time), the knee is forgotten at once (back to a confirmed larger one,
if one was held) and the next violation shrinks the aim as for any tail. It probes one sequence
more after `PROBE_WINDOWS` windows; a probe that breaks the target again, or whose batches serve
fewer rows per second than the held cap's of the same kind (a knee within the target that costs
more than its rows bring), doubles the wait (up to `MAX_PROBE_WINDOWS`); one that does neither
for a window forgets the knee (with nothing of the held cap to compare with, it goes on).

The cap grows to at most `CAP_GROWTH` times the most requests that actually ran in an interval
(plus one): a cap far above the running count (light load) would let a load step fill the
batch at once, past the target, and it can then only shrink as fast as requests finish. Within
that bound, each prompt chunk cut to the period, the batch still fills within a few intervals
of a burst; growing by 10% an interval held it back for tens of seconds.

It shrinks by admitting less: the scheduler treats a lower cap as holding back admissions
(under a preempting policy a more important request may still displace one running request at
the full cap, as at a static cap of that size: the count stays), and the budget never drops
below what the running requests need for one token each. It does not
raise the cap while the KV cache's free share is down to the watermark (admissions could not
use it). With `target_ttft_ms`, a TTFT p99 over it moves step time from decode rows to prefill
(a larger reserve, so a smaller cap), but only when no request waited for admission behind a
full limit (the cap, or a budget used up) within the window the p99 covers: a prefill reserve speeds up the
prompts already admitted, while TTFT spent waiting to be admitted is queueing, which a smaller
cap lengthens (fewer requests served at once, lower throughput, a longer queue). While the
window holds such queueing, a TTFT over the target steps the reserve back down towards
`PREFILL_RESERVE` instead. Time enters only through `now` arguments.

Holding TPOT instead (`hold="tpot"`, `--batch-control-hold tpot`): a request's TPOT is the mean
of its ITLs, so one long step costs it little if its other steps were short. Holding every
step's ITL gives that away twice: steps beside decode rows that have time to spare are cut all
the same (a prompt arriving beside them takes more, shorter steps), and where steps vary (a real
machine) the p99 of ITL sits above their mean, so the mean is held under the target by that
margin while the static pairs that meet TPOT run their steps at it. Each decoding request's next
token is due by its first token's time plus the due period (the aimed-at period) times the
tokens it has: met every time, its TPOT stays under that period after every token, whatever the
steps' lengths were. The scheduler calls `begin_step` with the running requests before each
step; the step may last until the earliest due token among the decoding ones (found when a
chunk is first cut that a bound known without a pass does not settle, over those that ran at
the step's start: a step of decode rows alone needs no pass over them, one preempted by
recompute before that gets no token from it, and one swapped in during the step is left out,
as its times predate its swap-out; the bound: if every running request with output tokens got
one when the step before's results came back, as its observation says, none is due before
`BEHIND_SHARE` of a period after that, so a chunk that fits in what is left of it fits under the
room, and in steady churn no pass is made;
`cut_chunk` cuts every prefill chunk to that, not to the period; a request computing its
context again after a recompute preemption gets no token before that prefill is done, so its
due time does not count; with no decoding request nothing is cut: no row waits), and the token
budget is the maximum (the cut does what it did). A request behind its due time (a step
longer than predicted, a preemption) still gets `BEHIND_SHARE` of a period for its next token:
it catches up by the rest each step, and one far behind does not hold every step to nothing.
A request sure of the N tokens it will have (it ignores EOS, has no stop ids or strings, and
a max_tokens: `Request.least_num_output_tokens`) only needs its last token on time: its TPOT
is that token's time since its first over N - 1. Due times on a gentler slope let it bank
that: its next token is due (tokens it has + credit x (N - 1)) / (1 + credit) periods after
its first, the credit a quarter of the hysteresis. Its last token is then due N - 1 periods
after its first, as without the credit, while one that has just had its first token may wait
credit x (N - 2) / (1 + credit) periods more for its second (a prompt arriving beside it goes
through in fewer steps). One that may stop at any token gets no credit: its next one may be
its last.
The feedback is on the p99 TPOT of the requests finished since the period last moved (those
before lived under another aim; `MIN_TPOTS` of them at least), in the same band, from a period
starting inside it (1 - hysteresis / 2 of the target) and never above its top; no knee is
looked for. The cap is chosen as when holding ITL.

A minimum budget whose full step the model predicts over the aimed-at period cannot meet the
target: every step that fills it violates, and the feedback then shrinks the cap (throughput)
for a tail the cap cannot remove. A minimum the user gave (`--min-num-batched-tokens`) is
kept, as vLLM keeps a limit it is given, but the controller says so: a warning once, with the
numbers, and `min_budget_over_target` in its stats (the engine's log line) while it lasts. The
default minimum (`DEFAULT_MIN_NUM_BATCHED_TOKENS`) is not the user's choice but a guard against
budgets so small that prompts crawl; the target is, so the default yields, down to the largest
budget that fits (never under a token per running request).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from tokenweir.checks import is_finite_number, is_integer
from tokenweir.core.batch_control import BatchController, StepLimits, StepObservation
from tokenweir.core.cost_model import StepComposition, StepCostModel, chunk_composition, load_cost_model
from tokenweir.core.step_timing import StepTimeCorrection

if TYPE_CHECKING:
    from tokenweir.request import Request

logger = logging.getLogger("tokenweir.batch_slo")

# The aimed-at period may grow by this share per window near the band (below).
GROWTH = 0.1
# The sequence cap may be at most this many times the requests that ran in an interval, plus
# one (a cap far above them would let a load step fill the batch at once).
CAP_GROWTH = 2.0
# The p99 feedback grows the aimed-at period by at most GROWTH per window (an overshoot costs
# a violation: shrinking is immediate), except back up to the model's own aim (bias 1, where
# the corrected model predicts steps of the target): there it doubles per window while the p99
# is under about half the target. A tail the limits cannot remove (another process on the
# CPU, the engine loop busy with a burst of arrivals) halves the aim every interval it lasts,
# down to its floor; 10% a window would then take some 24 windows (minutes, at the minimum
# budget while requests wait) to climb back. Past bias 1 only the p99 vouches for more, and
# light load (a few rows, a low p99) would let a doubling aim make room for a whole prompt.
MAX_GROWTH = 2.0
BIAS_RANGE = (0.1, 4.0)
# Steps measured since a shrink before the p99 over them may shrink again (a p99 of a handful
# of steps is their maximum: one noisy step would decide).
MIN_STEPS = 20
# A cap held under the batch at which the tail broke (see _adjust) is probed again, one seq
# more, after this many windows under the target; every probe that breaks it again doubles the
# wait, up to MAX_PROBE_WINDOWS (a knee that went away is found within that many windows, and
# the probes of one that stays cost ever fewer of the steps: the p99 converges under the target).
PROBE_WINDOWS = 4
MAX_PROBE_WINDOWS = 64
# A knee: the steps past it take at least this share more over the model's prediction than any
# step under it (steps the model predicts alike measure alike but for rounding and noise).
KNEE_STEP = 0.1
# Steps under a newly held cap that must be faster than the knee's (their median, over the
# model's prediction, by KNEE_STEP): few, the first ones, so a slowdown in time is still on.
KNEE_CONFIRM_STEPS = 5
# Share of the target left to prefill chunks when the sequence cap is full of decode rows;
# with a TTFT target it moves by RESERVE_STEP per interval up to MAX_RESERVE.
PREFILL_RESERVE = 0.1
RESERVE_STEP = 0.05
MAX_RESERVE = 0.5
# The cap stops growing this close to the watermark: admissions need free blocks above it.
MEMORY_MARGIN = 0.02
PERCENTILE = 0.99
# The minimum budget unless one is given: below it, prompts would crawl (each step pays its
# fixed cost for a few tokens). It yields to the target and to a smaller maximum.
DEFAULT_MIN_NUM_BATCHED_TOKENS = 64
# A prefill chunk is not cut below this many tokens (a chunk costs its step more than its
# tokens: a sequence of its own, its sampling); a step's first chunk gets them even when none
# fits beside the step's decode rows, so prompts progress whatever the aim.
MIN_CHUNK_TOKENS = 16
HOLDS = ("itl", "tpot")
# hold="tpot": a request behind its due time still gets this share of the due period for its
# next token (it catches up by the rest per step; one far behind, after a preemption, must not
# hold every step to nothing until it has), and the p99 of TPOT needs this many finished
# requests since the feedback last moved.
BEHIND_SHARE = 0.9
MIN_TPOTS = 10


@dataclass(frozen=True)
class SLOBatchConfig:
    """The knobs of `slo` (engine args `--target-tpot-ms`, `--min-num-batched-tokens`, ...); the
    upper bounds are the scheduler's `max_num_batched_tokens` and `max_num_seqs`."""

    target_tpot_ms: float
    target_ttft_ms: Optional[float] = None
    # None: DEFAULT_MIN_NUM_BATCHED_TOKENS, which yields when a full step of it cannot meet the
    # target (a given minimum is kept, with a warning).
    min_num_batched_tokens: Optional[int] = None
    min_num_seqs: int = 1
    # None: chosen by the cost model at the first step.
    initial_num_batched_tokens: Optional[int] = None
    initial_num_seqs: Optional[int] = None
    window: float = 10.0  # seconds of steps whose ITLs (and TTFTs) make the p99 (ITLs: at least MIN_STEPS)
    interval: float = 1.0  # seconds between adjustments
    hysteresis: float = 0.1
    # A step cost profile (tokenweir profile) to start from; None: the engine's, else the shipped one.
    cost_profile: Optional[str] = None
    # What is held under the target: "itl", every step's period (the windowed p99 of ITL, so
    # TPOT too); "tpot", each request's TPOT (its next token due by its first token's time plus
    # the target per token since: a step may outlast the target while every row has slack).
    hold: str = "itl"

    def __post_init__(self) -> None:
        for name in ("target_tpot_ms", "target_ttft_ms", "window", "interval"):
            value = getattr(self, name)
            if value is None and name == "target_ttft_ms":
                continue
            if not is_finite_number(value) or value <= 0:
                raise ValueError(f"batch control {name} must be a number > 0, got {value!r}")
        if self.hold not in HOLDS:
            raise ValueError(f"batch control hold must be one of {', '.join(HOLDS)}, got {self.hold!r}")
        if self.cost_profile is not None:  # refused with the arguments, not when an engine builds its scheduler
            load_cost_model(self.cost_profile)
        if not is_finite_number(self.hysteresis) or not 0 <= self.hysteresis < 1:
            raise ValueError(f"batch control hysteresis must be in [0, 1), got {self.hysteresis!r}")
        for name in ("min_num_batched_tokens", "min_num_seqs", "initial_num_batched_tokens", "initial_num_seqs"):
            value = getattr(self, name)
            if value is not None and (not is_integer(value) or value < 1):
                raise ValueError(f"batch control {name} must be an integer >= 1, got {value!r}")

    def check_bounds(self, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        """The minima and initial values against the maxima (the scheduler's limits)."""
        for kind, maximum in (("num_batched_tokens", max_num_batched_tokens), ("num_seqs", max_num_seqs)):
            low, initial = getattr(self, f"min_{kind}"), getattr(self, f"initial_{kind}")
            low = self.floor_num_batched_tokens(maximum) if low is None else low
            if low > maximum:
                raise ValueError(f"min_{kind} ({low}) must be <= max_{kind} ({maximum})")
            if initial is not None and not low <= initial <= maximum:
                raise ValueError(f"initial_{kind} ({initial}) must be within [min_{kind}, max_{kind}] "
                                 f"= [{low}, {maximum}]")
        if self.min_num_batched_tokens is not None and self.min_num_batched_tokens < self.min_num_seqs:
            raise ValueError(f"min_num_batched_tokens ({self.min_num_batched_tokens}) must be >= min_num_seqs "
                             f"({self.min_num_seqs}): every running request needs a token per step")
        tokens, seqs = self.initial_num_batched_tokens, self.initial_num_seqs
        if tokens is not None and seqs is not None and tokens < seqs:
            raise ValueError(f"initial_num_batched_tokens ({tokens}) must be >= initial_num_seqs ({seqs})")

    def floor_num_batched_tokens(self, max_num_batched_tokens: int) -> int:
        """The minimum budget: the given one, else the default within the maximum (and never
        under min_num_seqs: every running request needs a token per step)."""
        if self.min_num_batched_tokens is not None:
            return self.min_num_batched_tokens
        return max(self.min_num_seqs, min(DEFAULT_MIN_NUM_BATCHED_TOKENS, max_num_batched_tokens))


def _rate(steps: Iterable[tuple[float, int]]) -> float:
    """Rows per second of steps given as (period, rows); 0 without time."""
    periods = rows = 0.0
    for period, n in steps:
        periods += period
        rows += n
    return rows / periods if periods > 0 else 0.0


def weighted_quantile(samples: Iterable[tuple[float, int]], q: float) -> Optional[float]:
    """The q-quantile of values each counted `weight` times; None without samples."""
    ordered = sorted(samples)
    total = sum(w for _, w in ordered)
    if total == 0:
        return None
    threshold, seen = q * total, 0
    for value, weight in ordered:
        seen += weight
        if seen >= threshold:
            return value
    return ordered[-1][0]


def largest(low: int, high: int, fits: Callable[[int], bool]) -> int:
    """The largest n in [low, high] with fits(n), fits being monotone; low if none fits."""
    if not fits(low):
        return low
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


class SLOBatchController(BatchController):
    name = "slo"
    config_class = SLOBatchConfig

    @classmethod
    def from_config(cls, config: SLOBatchConfig, limits: StepLimits, cost_model: Optional[StepCostModel],
                    watermark: float) -> SLOBatchController:
        # One given by path wins; without one (the engine holds none unless `auto` preemption
        # asked), the shipped profile: the measured correction scales it to this machine.
        if config.cost_profile is not None:
            cost_model = load_cost_model(config.cost_profile)
        return cls(config, limits, cost_model or load_cost_model(None), watermark)

    def __init__(self, config: SLOBatchConfig, max_limits: StepLimits, cost_model: StepCostModel,
                 watermark: float = 0.0) -> None:
        config.check_bounds(max_limits.max_num_batched_tokens, max_limits.max_num_seqs)
        self.config = config
        self.max_limits = max_limits
        self.cost_model = cost_model
        # The measured / predicted step period (core/step_timing.py) scales every prediction.
        self.timing = StepTimeCorrection(cost_model)
        self.watermark = watermark
        self.target = config.target_tpot_ms / 1000
        self.target_ttft = None if config.target_ttft_ms is None else config.target_ttft_ms / 1000
        self._hold_tpot = config.hold == "tpot"
        # The aimed-at period, as a share of the target. Holding TPOT, it is also each token's
        # due period, started inside the band (TPOT is each request's mean over its steps: no
        # p99 of noisy steps needs a margin under it).
        self.bias = 1 - config.hysteresis / 2 if self._hold_tpot else 1.0
        self.prefill_reserve = PREFILL_RESERVE
        self.p99_itl: Optional[float] = None  # at the last adjustment: of the steps since the last move
        self.p99_ttft: Optional[float] = None
        self.p99_tpot: Optional[float] = None  # hold="tpot": of the requests finished since the last move
        self._tpot: deque[tuple[float, float]] = deque()  # hold="tpot": (time, tpot) of finished requests
        # hold="tpot": how long the step being scheduled may last, until its earliest due token
        # (None: not yet found this step; see `room`), and the step's time and running requests.
        self._room: Optional[float] = math.inf
        self._step_now = 0.0
        self._step_running: Sequence[Request] = ()
        # hold="tpot": when the results came back of the last step observed, if every running
        # request with output tokens got one then (None otherwise); taken by the next step
        # (`_least_room`), as a step that fails is not observed.
        self._fresh_at: Optional[float] = None
        self._step_fresh_at: Optional[float] = None
        # hold="tpot": the share of a period per ITL that a request sure of its length may bank
        # (see the docstring). Its later tokens are then due 1 / (1 + credit) periods apart, so a
        # larger credit leaves less room to catch up after a step longer than predicted.
        self._credit = config.hysteresis / 4
        self.min_num_batched_tokens = config.floor_num_batched_tokens(max_limits.max_num_batched_tokens)
        # The default minimum yields to the target; a given one is kept (see the docstring).
        self._min_yields = config.min_num_batched_tokens is None
        # At the last decision: a full step of the (kept) minimum budget is predicted over the
        # aimed-at period, so the target cannot be met by the budget.
        self.min_budget_over_target = False
        self._warned_min_budget = False
        self.limits = StepLimits(config.initial_num_batched_tokens or max(self.min_num_batched_tokens,
                                                                          config.initial_num_seqs or 1),
                                 config.initial_num_seqs or config.min_num_seqs)
        # (step end, period, rows, the cost model's own prediction of the step, seqs in the step,
        # whether it carried a prompt chunk: steps are compared by batch size only with their
        # own kind, see the knee in the module docstring)
        self._itl: deque[tuple[float, float, int, float, int, bool]] = deque()
        self._ttft: deque[tuple[float, float]] = deque()  # (time, ttft)
        self._next_adjust: Optional[float] = None
        self._context_per_request = 0.0
        self._num_running = 0
        self._peak_running = 0  # since the last adjustment
        self._kv_cache_usage = 0.0
        self._held_back = False  # since the last adjustment, a limit kept work out of a step
        # The last step in which requests waited for admission behind a full limit: TTFTs of
        # the window after it include queueing, which a larger prefill reserve would lengthen.
        self._queued_at = -math.inf
        self._moved_at = -math.inf  # when the feedback last moved the aimed-at period
        # The smallest batch (seqs in a step) measured to break the target where fewer met it,
        # more than the model predicted (a knee its shape lacks): the cap is held under it.
        self.broken_num_seqs: Optional[int] = None
        self._probe_windows = PROBE_WINDOWS
        self._probe_at = math.inf  # when the held cap may next try one seq more
        self._probing = False  # the cap may reach broken_num_seqs, to see whether it still breaks
        self._probe_since = 0.0
        # The smallest measured / model-predicted period of the steps that showed the knee, and
        # when the cap began to be held under it: the held steps must be faster (see above).
        self._knee_ratio = math.inf
        self._knee_chunked = False  # the kind of steps that showed it
        self._held_since = -math.inf
        self._knee_confirmed = False
        self._fallback: Optional[int] = None  # a confirmed knee a newer, smaller one replaced
        # Rows per second of the held cap's steps, at the last adjustment before a probe (the
        # probe's window may hold none of them, its batch filled by the probed size).
        self._held_before: Optional[float] = None

    def get_stats(self) -> dict[str, object]:
        return {"min_budget_over_target": self.min_budget_over_target, "broken_num_seqs": self.broken_num_seqs}

    @property
    def correction(self) -> float:
        """Measured / predicted step period so far (what scales every prediction)."""
        return self.timing.ratio

    # ------------------------------------------------------------------ the scheduler's calls

    def get_limits(self, now: float) -> StepLimits:
        if self._next_adjust is None:
            self._next_adjust = now + self.config.interval
            if self.config.initial_num_batched_tokens is None or self.config.initial_num_seqs is None:
                tokens, seqs = self._choose()
                given_tokens = self.config.initial_num_batched_tokens
                # A given budget bounds the chosen cap: every running request needs a token.
                seqs = self.config.initial_num_seqs or (min(seqs, given_tokens) if given_tokens else seqs)
                tokens = given_tokens or max(tokens, seqs)
                self.limits = StepLimits(tokens, seqs)
        elif now >= self._next_adjust:
            self._adjust(now)
            self._next_adjust = now + self.config.interval
        self.timing.begin_step(now)
        return self.limits

    def begin_step(self, now: float, running: Sequence[Request]) -> None:
        if self._hold_tpot:
            # The earliest due token is found when a chunk is first cut (`room`): a step of
            # decode rows alone (most steps under a full batch) needs no pass over them. Of the
            # requests running now: one swapped in later in the step is decoding, but its first
            # and last tokens date from before it was swapped out (its due time long past would
            # cut every chunk to the floor); the token this step gives it makes them fresh.
            self._step_now, self._step_running, self._room = now, list(running), None
            self._step_fresh_at, self._fresh_at = self._fresh_at, None

    @property
    def room(self) -> float:
        """hold="tpot": how long the step being scheduled may last, until the earliest due token
        of the requests that ran at its start and still decode when it is first asked for (one
        preempted by recompute before that gets no token from this step); inf without one."""
        if self._room is None:
            self._room = self._earliest_due(self._step_running) - self._step_now
        return self._room

    def _least_room(self) -> Optional[float]:
        """hold="tpot": a lower bound of `room` known without a pass over the running requests
        (None: none is). If every request with output tokens running at the step's start got
        one when the step before's results came back (`StepObservation.last_tokens_now`), no
        decoding one is due before BEHIND_SHARE of a period after that (its due time's floor)."""
        fresh_at = self._step_fresh_at
        return None if fresh_at is None else fresh_at + BEHIND_SHARE * (self.target * self.bias) - self._step_now

    def _earliest_due(self, running: Sequence[Request]) -> float:
        # A decoding request keeps its TPOT (its mean ITL so far) under the due period if its
        # next token comes by its first token's time plus that period per token it has; one
        # behind that (a step longer than predicted, a preemption) still gets BEHIND_SHARE of a
        # period, catching up by the rest per step.
        period = self.target * self.bias
        behind, credit = BEHIND_SHARE * period, self._credit
        earliest = math.inf
        for request in running:
            first = request.first_token_time
            # Only a decoding row (one token left to compute) gets a token this step: one
            # computing its context again after a recompute preemption gets none until that
            # prefill is done, and its due time (long past) would cut that prefill, and every
            # other prompt's, to the floor.
            if first is None:
                continue
            if len(request.all_token_ids) - request.num_computed_tokens != 1:
                continue
            sure = credit * max(0, request.least_num_output_tokens - 1)
            output = len(request.output_token_ids)
            due = first + (period * (output + sure) / (1 + credit) if sure else period * output)
            floor = request.last_token_time + behind
            if floor > due:
                due = floor
            if due < earliest:
                earliest = due
        return earliest

    def on_step(self, obs: StepObservation) -> None:
        period = self.timing.observe(obs)  # None: no decode row waited for this step
        if period is not None:
            comp = obs.composition
            self._itl.append((obs.now, period, obs.num_itl_rows, self.timing.predicted,
                              comp.num_decode_seqs + comp.num_prefill_seqs, comp.num_prefill_seqs > 0))
        for ttft in obs.ttfts:
            self._ttft.append((obs.now, ttft))
        if self._hold_tpot:
            for tpot in obs.tpots:
                self._tpot.append((obs.now, tpot))
            self._fresh_at = obs.now if obs.last_tokens_now else None
        if obs.num_running:
            self._context_per_request = obs.running_context_tokens / obs.num_running
        self._num_running = obs.num_running
        self._peak_running = max(self._peak_running, obs.num_running)
        self._kv_cache_usage = obs.kv_cache_usage
        limits, comp = self.limits, obs.composition
        # The cap held requests back if it was full while they waited: full in the step (its
        # rows), or after it (a request that finished in the step no longer runs).
        seqs = comp.num_decode_seqs + comp.num_prefill_seqs
        if (comp.num_tokens >= limits.max_num_batched_tokens
                or (obs.num_waiting and max(obs.num_running, seqs) >= limits.max_num_seqs)):
            self._held_back = True
            if obs.num_waiting > 0:
                self._queued_at = obs.now

    def cut_chunk(self, num_tokens: int, num_computed: int, total_tokens: int, num_prompt_tokens: int,
                  step: StepComposition, pending_rows: int) -> int:
        # A chunk's time grows with the prompt computed before it (its attention reads it all),
        # so a budget in tokens cannot keep steps under the aimed-at period: sized for chunks at
        # a prompt's start, one deep in a long prompt overshoots; sized for the deepest, every
        # other step falls short. Each chunk is cut to what the period has left instead, the
        # running requests still to be visited counted as decode rows.
        # Holding TPOT the step may last until its earliest due token (none: no row waits).
        period, predict = (self._room if self._hold_tpot else self.target * self.bias), self.timing.predict
        if period == math.inf:
            return num_tokens
        if pending_rows:
            step = step + StepComposition(
                num_decode_seqs=pending_rows, decode_context_tokens=math.ceil(pending_rows * self._context_per_request),
                num_sampled=pending_rows)

        def seconds(n: int) -> float:
            return predict(step + chunk_composition(n, num_computed, total_tokens, num_prompt_tokens))

        whole = seconds(num_tokens)
        if period is None:  # holding TPOT, the room not found yet this step
            least = self._least_room()
            if least is not None and whole <= least:
                return num_tokens  # it fits whatever the room: no pass over the running requests
            period = self.room
        if whole <= period:
            return num_tokens
        self._held_back = True
        floor = min(num_tokens, MIN_CHUNK_TOKENS)
        if seconds(floor) <= period:
            return largest(floor, num_tokens, lambda n: seconds(n) <= period)
        return floor if step.num_prefill_seqs == 0 else 0

    # ------------------------------------------------------------------ decisions

    def _adjust(self, now: float) -> None:
        h = self.config.hysteresis
        horizon = now - self.config.window
        # At least MIN_STEPS steps stay whatever their age: with steps long against the window
        # (a slow model, a short window) the p99 would otherwise never have enough to act on.
        while len(self._itl) > MIN_STEPS and self._itl[0][0] < horizon:
            self._itl.popleft()
        while self._ttft and self._ttft[0][0] < horizon:
            self._ttft.popleft()
        while len(self._tpot) > MIN_TPOTS and self._tpot[0][0] < horizon:
            self._tpot.popleft()
        violated = self._feedback_tpot(now) if self._hold_tpot else self._feedback_itl(now)
        self._adjust_reserve(now)
        self._held_back = False
        tokens, seqs = self._choose()
        seqs = min(seqs, max(self.config.min_num_seqs, math.ceil(self._peak_running * CAP_GROWTH) + 1))
        self._peak_running = 0
        current = self.limits

        def settle(new: int, old: int) -> int:
            return new if abs(new - old) > h * old or (violated and new < old) else old

        held = self._held_cap(seqs, now)
        # A held cap is a boundary measured, not noise: the cap goes to it whatever the hysteresis.
        seqs = held if held is not None and seqs >= held else settle(seqs, current.max_num_seqs)
        self.limits = StepLimits(max(settle(tokens, current.max_num_batched_tokens), seqs), seqs)

    def _feedback_tpot(self, now: float) -> bool:
        """hold="tpot": the aimed-at (due) period moves on the p99 TPOT of the requests that
        finished since it last moved (those before lived under another aim), inside the band as
        for ITL; no knee is looked for (a step's length is the due times', not the batch's).
        Whether the target was violated."""
        h = self.config.hysteresis
        since = [(t, 1) for end, t in self._tpot if end > self._moved_at]
        self.p99_tpot = p99 = weighted_quantile(since, PERCENTILE) if len(since) >= MIN_TPOTS else None
        ceiling = self.target * (1 - h / 4)
        if p99 is not None and p99 > ceiling:
            self.bias = max(BIAS_RANGE[0], self.bias * max(0.5, ceiling / p99))
            self._moved_at = now
            return True
        if (p99 is not None and p99 < self.target * (1 - h) and self._held_back
                and now - self._moved_at >= self.config.window):
            self.bias = min(1 - h / 4, self.bias * min(1 + GROWTH, self.target * (1 - h / 2) / p99))
            self._moved_at = now
        return False

    def _feedback_itl(self, now: float) -> bool:
        """hold="itl": the aimed-at period (and the knee's memory) moves on the windowed p99 of
        the steps' ITL since it last moved. Whether the target was violated."""
        h = self.config.hysteresis
        since = [step for step in self._itl if step[0] > self._moved_at]
        enough = len(since) >= MIN_STEPS
        self.p99_itl = p99 = weighted_quantile(((p, n) for _, p, n, *_ in since), PERCENTILE) if enough else None
        ceiling = self.target * (1 - h / 4)
        violated = p99 is not None and p99 > ceiling
        self._confirm_knee()
        if violated:
            knee = self._broken_batch(since, ceiling)
            if knee is not None:
                # The tail is the larger batches' alone: holding the cap under them removes it,
                # so the aim stays (shrinking it too would cut the batches that met the target).
                broken, ratio, chunked = knee
                self._hold_under(broken, ratio, now, chunked)
            else:
                self.bias = max(BIAS_RANGE[0], self.bias * max(0.5, ceiling / p99))
            self._moved_at = now
        else:
            # Growth needs the p99 of the steps measured under the band, and also that of steps
            # filling the aimed-at period: that period times the p99 of measured over (corrected)
            # predicted periods. The measured p99 alone vouches for more than was tried: steps
            # smaller than the limits (a cap full of decode rows, no prompt chunk in them)
            # measure short, and an aim grown on them overshoots once chunks join the rows
            # (every admission brings one). The scaled one alone misses steps the aim's
            # prediction undercounts (a chunk deep in a long prompt), which the measured p99 sees.
            tail = weighted_quantile(((p / pred, n) for _, p, n, pred, *_ in since if pred > 0),
                                     PERCENTILE) if enough else None
            expected = None if p99 is None or tail is None else max(
                p99, tail / self.timing.ratio * self.target * self.bias)
            if (expected is not None and expected < self.target * (1 - h) and self._held_back
                    and now - self._moved_at >= self.config.window):
                room = self.target * (1 - h / 2) / expected
                if self.bias < 1 and room >= MAX_GROWTH:  # climbing back to the model's own aim
                    self.bias = min(1.0, self.bias * MAX_GROWTH)
                else:
                    self.bias = min(BIAS_RANGE[1], self.bias * min(1 + GROWTH, room))
                self._moved_at = now
            if self._probing and now - self._probe_since >= self.config.window:
                self._end_probe(now)
        return violated

    def _adjust_reserve(self, now: float) -> None:
        """With a TTFT target: the prefill reserve moves on its p99 (see the module docstring)."""
        h = self.config.hysteresis
        if self.target_ttft is not None:
            self.p99_ttft = weighted_quantile(((t, 1) for _, t in self._ttft), PERCENTILE)
            if self.p99_ttft is not None:
                # The p99 covers the window, so the queueing that counts is the window's too.
                if self.p99_ttft > self.target_ttft and now - self._queued_at <= self.config.window:
                    # Queueing: a larger reserve (a smaller cap) would lengthen it.
                    self.prefill_reserve = max(PREFILL_RESERVE, self.prefill_reserve - RESERVE_STEP)
                elif self.p99_ttft > self.target_ttft:
                    self.prefill_reserve = min(MAX_RESERVE, self.prefill_reserve + RESERVE_STEP)
                elif self.p99_ttft < self.target_ttft * (1 - h):
                    self.prefill_reserve = max(PREFILL_RESERVE, self.prefill_reserve - RESERVE_STEP)

    @staticmethod
    def _broken_batch(steps: list[tuple[float, float, int, float, int, bool]],
                      ceiling: float) -> Optional[tuple[int, float, bool]]:
        """(The smallest batch over `ceiling`, the smallest measured / predicted period of the
        steps of that batch or larger, whether they carried prompt chunks) if, among the steps of
        one kind (with chunks, or decode rows alone), the tail is in the batch size: some steps
        of that kind had fewer seqs, and every one of that many seqs or more took more over the
        cost model's prediction than every one of them, by KNEE_STEP at least (a knee the
        model's shape lacks, which the one correction ratio, learnt on the batches below it,
        cannot predict; over the model's own prediction, not the corrected one, so that a ratio
        still converging is not taken for a knee). None otherwise: a tail at any batch size, or
        in longer steps the model foresaw, is the aim's to shorten."""
        found: Optional[tuple[int, float, bool]] = None
        for chunked in (False, True):
            kind = [(p, pred, seqs) for _, p, _, pred, seqs, c in steps if c is chunked and pred > 0]
            over = [seqs for p, _, seqs in kind if p > ceiling]
            if not over:
                continue
            knee = min(over)
            below = [p / pred for p, pred, seqs in kind if seqs < knee]
            above = [p / pred for p, pred, seqs in kind if seqs >= knee]
            if below and min(above) > max(below) * (1 + KNEE_STEP) and (found is None or knee < found[0]):
                found = (knee, min(above), chunked)
        return found

    def _confirm_knee(self) -> None:
        """A knee just remembered stays only if the steps under the held cap are faster than its
        own by KNEE_STEP (over the model's prediction): otherwise the larger batches were slow
        for their time, not their size (see the module docstring)."""
        broken = self.broken_num_seqs
        if broken is None or self._knee_confirmed or self._probing:
            return
        # The first steps under the hold, right after the knee showed: a slowdown in time is
        # still on then (later ones would tell only whether it has passed).
        held = sorted([p / pred for t, p, _, pred, seqs, chunked in self._itl
                       if t > self._held_since and seqs < broken and chunked is self._knee_chunked
                       and pred > 0][:KNEE_CONFIRM_STEPS])
        if len(held) < KNEE_CONFIRM_STEPS:
            return
        if held[len(held) // 2] * (1 + KNEE_STEP) < self._knee_ratio:
            self._knee_confirmed, self._fallback = True, None
        else:  # back to the confirmed knee it replaced, if any
            self.broken_num_seqs, self._probe_windows = self._fallback, PROBE_WINDOWS
            self._knee_confirmed, self._fallback = self._fallback is not None, None

    def _end_probe(self, now: float) -> None:
        """A window after a probe began without breaking the target: were batches of
        broken_num_seqs worth it? They are if they served more rows per second than the largest
        batch under them (the knee has gone, or costs less than its rows bring): the memory
        goes and the cap grows as the model says. If they served fewer (a knee under the
        target, but one whose steps cost more than their extra rows), the cap is held again."""
        broken = self.broken_num_seqs
        if broken is None:
            return
        kind = self._knee_chunked
        large = [(p, n) for t, p, n, _, seqs, chunked in self._itl
                 if t > self._probe_since and seqs >= broken and chunked is kind]
        if not large:
            return  # no batch that large ran yet (load fell): the probe goes on
        held = self._held_rate()
        if held is None:
            held = self._held_before
        if held is None:
            return  # nothing of the held cap to compare with: the probe goes on
        if _rate(large) > held:
            self.broken_num_seqs, self._probing, self._probe_windows = None, False, PROBE_WINDOWS
        else:
            self._hold_under(broken, None, now)

    def _held_rate(self) -> Optional[float]:
        """Rows per second of the window's steps at the largest batch under broken_num_seqs, of
        the knee's kind (like with like: the probe's batches are counted the same way)."""
        broken, kind = self.broken_num_seqs, self._knee_chunked
        held = max((seqs for *_, seqs, chunked in self._itl if broken is not None and seqs < broken
                    and chunked is kind), default=None)
        return None if held is None else _rate([(p, n) for _, p, n, _, seqs, chunked in self._itl
                                                if seqs == held and chunked is kind])

    def _hold_under(self, broken: int, ratio: Optional[float], now: float, chunked: bool = False) -> None:
        """Hold the cap under `broken` seqs, which broke the target where fewer met it (`ratio`:
        the smallest measured / predicted period of those steps, `chunked` their kind; None: a
        probe showed it was not worth its rows). Without the memory the limit cycles: the correction ratio, raised
        by the broken steps, shrinks the cap; under the knee it falls back; the model's cap then
        crosses the knee again."""
        if self._probing:  # it broke again: the knee is still there, probe it less often
            self._probe_windows = min(MAX_PROBE_WINDOWS, 2 * self._probe_windows)
            self._knee_confirmed = True
        elif ratio is not None and (self.broken_num_seqs is None or broken < self.broken_num_seqs):
            # A new knee (or a smaller one): it must show again under the held cap; a confirmed
            # one it replaces is what a rejection goes back to.
            if self._knee_confirmed:
                self._fallback = self.broken_num_seqs
            self._knee_ratio, self._knee_chunked, self._held_since, self._knee_confirmed = ratio, chunked, now, False
        held = self.broken_num_seqs
        self.broken_num_seqs = broken if held is None or self._probing else min(held, broken)
        self._probing = False
        self._probe_at = now + self._probe_windows * self.config.window

    def _held_cap(self, seqs: int, now: float) -> Optional[int]:
        """The cap held under the batch that broke the target (None: none is held), one seq
        higher while a probe is on; a probe starts once due, and only if the model's cap `seqs`
        is held back by it (otherwise the probe would test nothing)."""
        if self.broken_num_seqs is None:
            return None
        held = max(self.config.min_num_seqs, self.broken_num_seqs - 1)
        if not self._probing and now >= self._probe_at and seqs > held:
            self._probing, self._probe_since, self._held_before = True, now, self._held_rate()
        return min(self.max_limits.max_num_seqs, held + 1) if self._probing else held

    def _choose(self) -> tuple[int, int]:
        """The model's limits: (token budget, sequence cap) for the aimed-at period."""
        cfg, top = self.config, self.max_limits
        period = self.target * self.bias
        context = self._context_per_request

        def seconds(num_decode: int, num_prefill: int) -> float:
            comp = StepComposition(
                num_prefill_tokens=num_prefill, num_prefill_seqs=int(num_prefill > 0), num_decode_seqs=num_decode,
                decode_context_tokens=math.ceil(num_decode * context),
                prefill_attention_pairs=num_prefill * (num_prefill + 1) // 2,
                num_sampled=num_decode + int(num_prefill > 0))
            return self.timing.predict(comp)

        seqs = largest(cfg.min_num_seqs, top.max_num_seqs,
                       lambda s: seconds(s, 0) <= period * (1 - self.prefill_reserve))
        if 1 - self._kv_cache_usage <= self.watermark + MEMORY_MARGIN:
            seqs = min(seqs, max(cfg.min_num_seqs, self.limits.max_num_seqs))
        if self._hold_tpot:
            # Each prompt chunk is cut to its step's due times (cut_chunk): a budget in tokens
            # would only stop steps that every row has the slack for.
            return top.max_num_batched_tokens, seqs
        # The budget fills the period for the decode rows there are (a full cap's worth would
        # leave the prompts waiting behind fewer rows a too small budget); re-decided each
        # interval as the batch grows.
        rows = min(seqs, max(self._num_running, 1))
        low = max(self.min_num_batched_tokens, seqs)

        def fits(b: int) -> bool:
            return seconds(rows, b - rows) <= period

        tokens = largest(low, top.max_num_batched_tokens, fits)
        self.min_budget_over_target = not fits(low) and low > seqs
        if self.min_budget_over_target:
            if self._min_yields:  # the largest budget that fits, down to the cap's rows
                tokens, self.min_budget_over_target = largest(seqs, low, fits), False
            elif not self._warned_min_budget:
                self._warned_min_budget = True
                feasible = largest(seqs, low, fits)
                logger.warning(
                    "slo: a full step of min_num_batched_tokens=%d (decode rows: %d) is predicted to take "
                    "%.1f ms, over the %.1f ms aimed at (target_tpot_ms %.1f): steps that fill it miss the "
                    "target and the cap shrinks instead; the largest budget that fits is %s",
                    low, rows, 1000 * seconds(rows, low - rows), 1000 * period, cfg.target_tpot_ms,
                    feasible if fits(feasible) else "none (the decode rows alone are over)")
        # Never fewer tokens than the running requests need to decode one each.
        tokens = max(tokens, min(top.max_num_batched_tokens, self._num_running))
        return tokens, seqs

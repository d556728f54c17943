"""The adaptive priority score of `sla` (seed 003 §3.1), its knobs and its parts.

Higher scores are served first and preempted last:

    score = -priority * base_weight                       (vLLM's sense: smaller is more important)
          + urgency * load_adjustment * urgency_weight
          - log(prompt + max_tokens) / resource_scale * resource_weight   (shorter first)
          + fairness compensation of the request's priority class
          + aging_rate * (now - arrival)

- urgency = 2 * sigmoid(-|now - due| / time_window), due the earliest of: the deadline;
  arrival + ttft_slo before the first token; the last token + tpot_slo while decoding. 1 at the
  due time, 0.54 one window before (or after), towards 0 with slack to spare; 0 without any
  SLO. It fades again once the due time has passed: a request that has missed its SLO gains
  nothing from going first, and under overload every waiting request is late, so an urgency
  that stayed high (the seed's sigmoid, which also had its sign reversed) would put the
  hopeless ahead of those that can still make it. Aging and max_wait still bound its wait.
- load_adjustment = max(0, 1 + (load - load_threshold) * load_sensitivity), so urgency weighs
  more as the engine saturates. load = max(queue share, kv_load_weight * KV usage): the queue
  share is the share of unfinished requests that wait (waiting / (waiting + running)), the KV
  usage the share of KV blocks held by requests after the latest step. Either one full means
  overload: a backlog of short prompts queues up with the KV cache half empty, one of long
  prompts fills the KV cache (and stalls admission) with few requests waiting. The larger of
  the two, not a blend: a blend would dilute each signal by the other's absence, reading a
  full queue of short prompts as half loaded. With kv_load_weight <= 1 load stays a share in
  [0, 1], so the bound on urgency below holds whatever the KV usage.
- fairness compensation of class c = fairness_factor * (expected_c - served_c) when
  served_c < 0.8 * expected_c, else 0; served_c is the class's share of the tokens computed and
  expected_c its share of the tokens asked for, both decayed over `fairness_window` seconds.
- aging grows the score of every request alike, so it keeps order among requests of one kind
  and lets an old request overtake newer ones; in addition a request that has waited
  `max_wait` seconds is served before every request that has not, oldest first, and is not
  preempted for a younger one: that bounds every wait, whatever the weights and priorities (a
  hard guarantee the sum of bounded terms cannot give when priorities span 2**32).

The defaults order the terms so that each does one job. U = urgency_weight x the largest load
adjustment (1 + (1 - load_threshold) x load_sensitivity) is the most urgency can add (3).
- One priority level (base_weight 10) is worth U plus aging over max_wait plus the largest
  class compensation (3 + 6 + 1): below max_wait, priority is a strict order as in `priority`,
  and a more important request preempts a less important one at once (preempt_margin < one
  level). With a smaller base_weight, urgency and compensation trade across levels: a batch
  request at its due time then outranks a fresh interactive one, and interactive requests miss
  their SLOs under overload for batch requests that mostly miss theirs anyway.
- Within a level, urgency orders requests by their due times, serving first those that can
  still meet their SLO; aging (0.01/s) lets a request that has missed it overtake on-time ones
  after U / aging_rate = max_wait / 2 of extra waiting, so a late backlog drains oldest first
  before it reaches max_wait. Requests that reach max_wait outrank every level: the weaker the
  aging, the more of them there are under sustained overload, each taking a slot from the most
  important requests.

Requests are grouped into `num_priority_classes` classes (priority clamped to [0, n-1]): the
unit of fairness compensation and of the per-class metrics, so label cardinality is bounded.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Optional

from tokenweir.checks import is_finite_number, is_integer
from tokenweir.core.cost_model import load_cost_model
from tokenweir.core.policies.base import PolicyConfig
from tokenweir.core.policies.fair_share import VTCConfig
from tokenweir.request import Request

# Below the served share 0.8 x the expected share a class gets compensation (the seed's rule).
FAIRNESS_SHORTFALL = 0.8
# The margin drop_unmeetable sheds by when unmeetable_margin is not given.
UNMEETABLE_MARGIN = 0.8
# exp() of the sigmoid argument is clamped here: beyond it the sigmoid is 0 or 1 in floats.
_SIGMOID_CLAMP = 60.0


@dataclass(frozen=True)
class SLAConfig(PolicyConfig):
    base_weight: float = 10.0  # score per priority level: more than every other term (see above)
    urgency_weight: float = 2.0  # the urgency term at the due time (load adjustment 1)
    time_window: float = 1.0  # seconds: the sigmoid's scale (one window from due: urgency 0.54)
    resource_weight: float = 0.1
    resource_scale: float = 10.0  # log(tokens) is divided by it (log(4096) / 10 = 0.83)
    load_threshold: float = 0.5  # load (see above: queue share or weighted KV usage) of adjustment 1
    load_sensitivity: float = 1.0
    # KV usage's weight in the load (0: queue depth only). 1: a KV cache full of requests is as
    # loaded as an engine whose unfinished requests all wait.
    kv_load_weight: float = 1.0
    fairness_factor: float = 1.0
    fairness_window: float = 30.0  # seconds over which class shares decay
    # Score per second waited: a request late by max_wait / 2 more than an on-time one of its
    # level outranks it (U / aging_rate = 300 s); not a priority level before max_wait.
    aging_rate: float = 0.01
    max_wait: float = 600.0  # seconds: after this a request is served before all younger ones
    # A waiting request preempts only a victim scored this much lower: about the urgency swing
    # between two requests of one kind, one at its due time and one on time (urgency_weight *
    # (1 - 0.5) * load adjustment up to 1.5), so that a request displaces a less important one
    # at once (less than one level) and one of its own kind rarely.
    preempt_margin: float = 1.5
    max_preemptions: int = 2  # k: a request preempted k times is not preempted for another
    drop_expired: bool = False  # finish requests whose deadline has passed (overload shedding)
    # Also finish, before their deadline passes, requests that cannot meet it by the step cost
    # model (cost_profile, scaled by the measured step times): its lower bound of the time the
    # request still needs served alone from now (its remaining prefill in one step, then the
    # decode steps it must still take; sla.py), times unmeetable_margin, does not fit in the
    # time left. An estimate from a fitted model, not a proof: the margin (< 1) is its slack.
    # Sheds expired requests too (a passed deadline cannot be met).
    drop_unmeetable: bool = False
    # None: UNMEETABLE_MARGIN. None rather than 0.8 as the default, so that a margin given
    # without drop_unmeetable is refused whatever its value, 0.8 too: it would do nothing, and
    # be taken for shedding that works (as the slo batch knobs without batch_controller 'slo').
    unmeetable_margin: Optional[float] = None
    # Keep a less important prefill out of a step that would make a more important request
    # miss its TTFT or TPOT SLO (sla_guard.py), by the step times of `cost_profile`.
    protect_slos: bool = True
    cost_profile: Optional[str] = None  # a `tokenweir profile` JSON; None: the shipped CPU profile
    # Scale the guard's predictions by measured / predicted step periods (core/step_timing.py):
    # the profile may be of another machine. Off: the profile's times as they are.
    step_time_correction: bool = True
    num_priority_classes: int = 4
    tenant_fairness: bool = False  # within a class, tenants by VTC (band -> tenant -> score)
    vtc: VTCConfig = field(default_factory=VTCConfig)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("float", float) and not is_finite_number(value):
                raise ValueError(f"sla {f.name} must be a finite number, got {value!r}")
        for name in ("base_weight", "urgency_weight", "resource_weight", "load_sensitivity",
                     "fairness_factor", "aging_rate", "preempt_margin", "load_threshold", "kv_load_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"sla {name} must be >= 0, got {getattr(self, name)!r}")
        if self.load_threshold > 1:
            # load is a share (at most 1): a threshold above it turns urgency off for good
            raise ValueError(f"sla load_threshold must be in [0, 1] (load is a share: of the unfinished "
                             f"requests waiting, or of the KV cache in use), got {self.load_threshold!r}")
        if self.kv_load_weight > 1:
            # above 1 the load would pass 1, and urgency the most the defaults weigh it against
            # a priority level (U above)
            raise ValueError(f"sla kv_load_weight must be in [0, 1] (it scales the KV usage, a share, into "
                             f"the load, itself a share), got {self.kv_load_weight!r}")
        for name in ("time_window", "resource_scale", "fairness_window", "max_wait"):
            if getattr(self, name) <= 0:
                raise ValueError(f"sla {name} must be > 0, got {getattr(self, name)!r}")
        for name, minimum in (("max_preemptions", 0), ("num_priority_classes", 1)):
            value = getattr(self, name)
            if not is_integer(value) or value < minimum:
                raise ValueError(f"sla {name} must be an integer >= {minimum}, got {value!r}")
        if self.cost_profile is not None:
            if not isinstance(self.cost_profile, str):
                raise ValueError(f"sla cost_profile must be a path, got {self.cost_profile!r}")
            load_cost_model(self.cost_profile)  # refused with the arguments, not when an engine builds its policy
        for name in ("drop_expired", "drop_unmeetable", "tenant_fairness", "protect_slos", "step_time_correction"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"sla {name} must be true or false, got {getattr(self, name)!r}")
        margin = self.unmeetable_margin
        if margin is not None and not (is_finite_number(margin) and 0 < margin < 1):
            raise ValueError(f"sla unmeetable_margin must be in (0, 1): the share of the cost model's lower "
                             f"bound of a request's remaining time that must still not fit in the time left "
                             f"before it is shed, got {margin!r}")
        if not self.drop_unmeetable and margin is not None:
            raise ValueError(f"sla unmeetable_margin ({margin!r}) applies only with drop_unmeetable")
        if self.drop_unmeetable and self.cost_profile is None and not self.step_time_correction:
            # The shipped profile is of one model on one CPU: uncorrected, it could call a
            # request on another machine hopeless that would finish in time.
            raise ValueError("sla drop_unmeetable needs step times of this machine: give cost_profile (a "
                             "`tokenweir profile` JSON taken on it) or keep step_time_correction on (it "
                             "scales the shipped CPU profile by the measured step times)")
        if not isinstance(self.vtc, VTCConfig):
            raise ValueError(f"sla vtc must be a VTCConfig, got {type(self.vtc).__name__}")


def priority_class(priority: int, num_classes: int) -> int:
    """The bounded class of a priority: <= 0 is class 0, >= n-1 the last."""
    return 0 if priority <= 0 else min(priority, num_classes - 1)


def urgency(now: float, due: float, window: float) -> float:
    """2 * sigmoid(-|now - due| / window): 1 at the due time; 0 without one (due = inf)."""
    if due == math.inf:
        return 0.0
    # sigmoid() inlined (the same float: doubling is exact): the queue's walk calls this for
    # every entry it scores and every bound it takes.
    return 2.0 / (1.0 + math.exp(min(abs(now - due) / window, _SIGMOID_CLAMP)))


def sigmoid(x: float) -> float:
    if x < -_SIGMOID_CLAMP:
        x = -_SIGMOID_CLAMP
    elif x > _SIGMOID_CLAMP:
        x = _SIGMOID_CLAMP
    return 1.0 / (1.0 + math.exp(-x))


def due_time(request: Request) -> float:
    """When the request's next SLO falls due (inf without one)."""
    due = math.inf
    if request.deadline is not None:
        due = request.deadline
    if request.first_token_time is None:
        if request.ttft_slo is not None:
            due = min(due, request.arrival_time + request.ttft_slo)
    elif request.tpot_slo is not None and request.last_token_time is not None:
        due = min(due, request.last_token_time + request.tpot_slo)
    return due


def static_key(request: Request, cfg: SLAConfig) -> float:
    """The score's part that does not change while the request waits, with aging counted from
    time 0: score = static_key + aging_rate * now + urgency part + class terms."""
    max_tokens = request.sampling_params.max_tokens or 0
    resource = math.log(request.num_prompt_tokens + max_tokens) / cfg.resource_scale
    return (-cfg.base_weight * request.priority - cfg.resource_weight * resource
            - cfg.aging_rate * request.arrival_time)


@dataclass
class ScoreParts:
    """One request's score, term by term (what debug logs and get_stats() show). Not frozen:
    one is built for every request popped (5 a step under churn), and a frozen dataclass sets
    each of its 11 fields through object.__setattr__, several times the cost of a plain one."""

    base: float  # -priority * base_weight
    urgency: float  # 0..1, 1 at the due time
    load_adjustment: float
    urgency_term: float  # urgency * load_adjustment * urgency_weight
    resource: float  # log(prompt + max_tokens) / resource_scale
    resource_term: float  # -resource * resource_weight
    fairness: float  # the class's compensation
    aging: float  # aging_rate * (now - arrival)
    total: float
    priority_class: int
    aged: bool  # waited max_wait: served before all that have not

    def as_dict(self) -> dict[str, object]:
        # Its fields are its __dict__ (no slots): copied whole, a quarter of the cost of a pass
        # over fields() (get_stats(now) builds a few of these after every step).
        return dict(self.__dict__)


def score_parts(request: Request, now: float, cfg: SLAConfig, load_adjustment: float,
                fairness: float) -> ScoreParts:
    base = -cfg.base_weight * request.priority
    urgency_value = urgency(now, due_time(request), cfg.time_window)
    urgency_term = urgency_value * load_adjustment * cfg.urgency_weight
    max_tokens = request.sampling_params.max_tokens or 0
    resource = math.log(request.num_prompt_tokens + max_tokens) / cfg.resource_scale
    resource_term = -cfg.resource_weight * resource
    wait = now - request.arrival_time
    aging = cfg.aging_rate * wait
    total = base + urgency_term + resource_term + fairness + aging
    return ScoreParts(base, urgency_value, load_adjustment, urgency_term, resource, resource_term, fairness,
                      aging, total, priority_class(request.priority, cfg.num_priority_classes),
                      wait >= cfg.max_wait)

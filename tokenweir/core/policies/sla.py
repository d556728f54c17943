"""`sla`: adaptive priority by score (sla_score.py), with fairness, aging, hysteresis and
options to shed requests whose deadline has passed or cannot be met.

Preemption ranks by the same score. Two rules keep it from thrashing:
- hysteresis: a waiting request preempts a running one only if its score is higher by
  `preempt_margin`;
- protection: a request preempted `max_preemptions` (k) times is never preempted again for a
  waiting request, so no request loses its work more than k times to others and no two
  requests take turns preempting each other more than k times. (Under KV pressure from the
  running requests' own growth, a protected request is chosen only when every running request
  is protected: someone must give way.)
A waiting request preempts only when that makes room for it: the scheduler counts the victims'
blocks exactly before preempting anyone.

The SLO guard (sla_guard.py) keeps a less important prefill out of a step that would make a
more important request miss its TTFT or TPOT SLO; with `step_time_correction` its predicted
step times are corrected by the measured ones (`on_step_observed`).

Shedding (`take_expired`): with drop_expired, a request is finished once its deadline has
passed; with drop_unmeetable also once the step cost model says it cannot finish in time even
served alone from now: margin x ratio x `StepCostModel.least_service_seconds` of the scheduler's
`least_remaining_work` (its remaining prefill after its prefix-cache hit in one step, then one
decode step alone per token it must still sample: min_tokens, or max_tokens when nothing can
stop it earlier) exceeds the time left. `ratio` is the step-time correction's low ratio (the
smallest measured / predicted of the last 32 steps, so a profile of a slower machine does not
make requests look hopeless; before 8 steps are measured nothing is judged unmeetable, since
a fresh engine's first steps may be a slow warm-up: step_timing.py), margin
`unmeetable_margin` < 1 the slack for a fitted model's error. It is an estimate, not a proof.

No pass over the waiting requests: one heap holds every unfinished request with a deadline,
keyed by when to look at it again, its latest start (deadline - margin x ratio x bound) as of
its last look. A request is looked at once it arrives (at the next step, with its hit; one
that arrives before the step times are trusted, keyed by its deadline until the first step
they are) and then when its key passes; a look sheds it or pushes it back with a fresh key.
Its bound only shrinks as it runs, and grows only when it is preempted (a recompute victim,
back with its outputs to compute again), when it is looked at again on being put back; so
keys are early (an extra look), and late only if the ratio rose or a cached prefix was evicted
since (then it is shed later, never wrongly: a request is shed only by a look at its state
now). So a step costs the policy a look per arrival, per preemption and per key passed, not
per waiting request.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import math
import operator
from collections.abc import Callable, Sequence
from typing import Optional

from tokenweir.core.batch_control import StepObservation
from tokenweir.core.cost_model import RemainingWork, StepTally, load_cost_model
from tokenweir.core.policies.base import SchedulingPolicy, ServedRequest, served_parts
from tokenweir.core.policies.fair_share import VirtualTokenCounters
from tokenweir.core.policies.sla_guard import SLOGuard
from tokenweir.core.policies.sla_queue import SLAQueue
from tokenweir.core.policies.sla_score import (FAIRNESS_SHORTFALL, UNMEETABLE_MARGIN, SLAConfig, ScoreParts,
                                               due_time, priority_class, score_parts, sigmoid, static_key,
                                               urgency)
from tokenweir.core.queues import RequestQueue
from tokenweir.core.step_timing import StepTimeCorrection
from tokenweir.request import Request

logger = logging.getLogger("tokenweir.sla")

# How many requests' most recent score parts get_stats() keeps (the last admitted and victims).
_EXPLAINED = 64
# A lower bound of scores proves "no preemption" only with this to spare: the bound and the
# exact score sum the same terms in another order, which may round the other way.
_BOUND_SLACK = 1e-9
_PRIORITY = operator.attrgetter("hints.priority")


class SLAPolicy(SchedulingPolicy):
    name = "sla"
    config_class = SLAConfig

    def __init__(self, config: Optional[SLAConfig] = None) -> None:
        super().__init__(config)
        cfg = self.config
        self.counters = VirtualTokenCounters(cfg.vtc) if cfg.tenant_fairness else None
        n = cfg.num_priority_classes
        cost_model = load_cost_model(cfg.cost_profile) if cfg.protect_slos or cfg.drop_unmeetable else None
        self.guard = SLOGuard(cost_model, n) if cfg.protect_slos else None
        # The step times unmeetable shedding predicts by: the guard's (one correction, fed once a
        # step), or its own without a guard.
        self.timing: Optional[StepTimeCorrection] = (
            self.guard.timing if self.guard is not None
            else StepTimeCorrection(cost_model) if cost_model is not None else None)
        # Tokens asked for and tokens computed per class, decayed over fairness_window.
        self._demand = [0.0] * n
        self._served = [0.0] * n
        self._decayed_at = 0.0
        self.load = 0.0
        self.queue_load = 0.0  # the load's two signals (see sla_score.py), for get_stats()
        self.kv_load = 0.0
        # KV cache usage after the latest step (on_step_observed): the blocks the requests hold
        # as the next begin_step finds them (the step's finished requests already freed). Only
        # an abort between steps, or a failed step (not observed), leaves it high for a step.
        self.kv_usage = 0.0
        self.load_adjustment = 1.0
        self.fairness = [0.0] * n
        self._now = 0.0
        self._running_scores: dict[str, float] = {}  # this step's scores of running requests
        self._statics: dict[str, tuple[Request, float, int, float]] = {}  # see _static
        self._admitting: Optional[Request] = None  # popped this step, being admitted now
        # Per class, at most the static key of every request that may be preemptible while
        # running: every request enters running by a pop from this policy's queues, which
        # lowers it; the running scan resets it. Leaving running, or becoming protected or
        # aged, only raises the true minimum, so a stale value is still a lower bound.
        self._key_floor = [math.inf] * n
        self._first_scan = False  # the next scan sees every running request (see select_victim)
        # Shedding (see the module's doc): (when to look at it next, seq, request id), a heap,
        # and request id -> (the seq of its live item, its tokens left to compute at that look,
        # the request). Heap items hold numbers and a string only, so CPython's collector
        # untracks them, and a finished request leaves `_deadline_entries` at once (see
        # on_step_served): held by the heap until compaction, every request served would stay
        # alive thousands of steps after it finished and be freed in bulk, which drove the
        # collector into young collections every few steps and full ones (see _Item in
        # sla_queue.py).
        self._deadlines: list[tuple[float, int, str]] = []
        self._deadline_entries: dict[str, tuple[int, int, Request]] = {}
        self._deadlines_kept = 0
        self._unlooked: list[Request] = []  # drop_unmeetable: arrivals and put-backs since the last look
        self._margin = UNMEETABLE_MARGIN if cfg.unmeetable_margin is None else cfg.unmeetable_margin
        self.num_shed = {"expired": 0, "unmeetable": 0}
        self._seq = itertools.count()
        self.explained: dict[str, ScoreParts] = {}
        # Every queue this policy ordered (the scheduler's waiting queue and its swapped queue):
        # each step re-weighs all of them.
        self._queues: list[SLAQueue] = []

    def make_waiting_queue(self) -> RequestQueue:
        queue = SLAQueue(self.config, self.counters, self._on_added, self._on_popped, self._on_put_back)
        self._queues.append(queue)
        return queue

    # ------------------------------------------------------------ arrivals and time

    def _on_added(self, request: Request) -> None:
        max_tokens = request.sampling_params.max_tokens or 0
        self._demand[priority_class(request.priority, self.config.num_priority_classes)] += (
            request.num_prompt_tokens + max_tokens)
        if request.deadline is None:
            return
        if self.config.drop_unmeetable:
            self._unlooked.append(request)  # looked at with its prefix-cache hit by the next step
            if self._unmeetable_ratio() is None:
                # Not judged until the step times are trusted (step_timing.LOW_RATIO_MIN_STEPS):
                # meanwhile it is shed once its deadline passes, as under drop_expired. Its
                # first look supersedes this key.
                self._push_deadline(request, request.deadline)
        elif self.config.drop_expired:
            self._push_deadline(request, request.deadline)

    def _on_put_back(self, request: Request) -> None:
        """A request back in a queue of this policy: passed over, preempted or not swapped in. A
        recompute victim has more to compute than at its last look (its outputs too): looked at
        again. Any other keeps a key that is early, or the one it had."""
        if self.config.drop_unmeetable and request.deadline is not None:
            entry = self._deadline_entries.get(request.request_id)
            # (Without an entry of its own it has not been looked at yet: it is among the unlooked.)
            if (entry is not None and entry[2] is request
                    and request.num_tokens - request.num_computed_tokens > entry[1]):
                self._unlooked.append(request)

    def begin_step(self, now: float, waiting: RequestQueue, running: Sequence[Request]) -> None:
        cfg = self.config
        self._now = now
        self._running_scores.clear()
        self._admitting = None
        if self.guard is not None:
            self.guard.begin_step(now, running)
        elif self.timing is not None:
            self.timing.begin_step(now)
        if len(self._statics) > 2 * len(running) + 1024:  # those finished unscheduled (aborted), now and then
            live = {r.request_id for r in running}
            self._statics = {rid: v for rid, v in self._statics.items() if rid in live}
        num_waiting = len(waiting)
        total = num_waiting + len(running)
        self.queue_load = num_waiting / total if total else 0.0
        self.kv_load = cfg.kv_load_weight * self.kv_usage
        # The larger, not a blend: either signal full is overload (sla_score.py says why).
        self.load = max(self.queue_load, self.kv_load)
        self.load_adjustment = max(0.0, 1.0 + (self.load - cfg.load_threshold) * cfg.load_sensitivity)
        self._decay(now)
        self._update_fairness()
        assert any(waiting is q for q in self._queues), "the waiting queue must be one this policy made"
        for queue in self._queues:
            queue.urgency_scale = cfg.urgency_weight * self.load_adjustment
            queue.class_terms = self.fairness
            queue.age(now)

    def _decay(self, now: float) -> None:
        dt = now - self._decayed_at
        if dt <= 0:
            return
        factor = math.exp(-dt / self.config.fairness_window)
        self._demand = [d * factor for d in self._demand]
        self._served = [s * factor for s in self._served]
        self._decayed_at = now

    def _update_fairness(self) -> None:
        cfg = self.config
        total_demand, total_served = sum(self._demand), sum(self._served)
        if total_demand <= 0 or total_served <= 0:
            self.fairness = [0.0] * cfg.num_priority_classes
            return
        fairness = []
        for demand, served in zip(self._demand, self._served):
            expected, share = demand / total_demand, served / total_served
            fairness.append(cfg.fairness_factor * (expected - share)
                            if share < FAIRNESS_SHORTFALL * expected else 0.0)
        self.fairness = fairness

    # ------------------------------------------------------------ scores

    def score(self, request: Request, now: float) -> float:
        cfg = self.config
        return (static_key(request, cfg) + cfg.aging_rate * now
                + cfg.urgency_weight * self.load_adjustment * urgency(now, due_time(request), cfg.time_window)
                + self.fairness[priority_class(request.priority, cfg.num_priority_classes)])

    def score_parts(self, request: Request, now: float) -> ScoreParts:
        """The score of `request` now, term by term (the load adjustment and the class
        compensation of the latest begin_step); changes nothing."""
        cfg = self.config
        return score_parts(request, now, cfg, self.load_adjustment,
                           self.fairness[priority_class(request.priority, cfg.num_priority_classes)])

    def explain(self, request: Request, now: float) -> ScoreParts:
        """score_parts, also kept for get_stats() (the latest _EXPLAINED)."""
        parts = self.score_parts(request, now)
        explained = self.explained
        explained.pop(request.request_id, None)  # re-inserted: the newest last
        explained[request.request_id] = parts
        if len(explained) > _EXPLAINED:
            del explained[next(iter(explained))]
        return parts

    def explain_request(self, request: Request, now: float) -> Optional[dict[str, object]]:
        # Not kept among the explained: asking about a request must not push out of get_stats()
        # the parts of the decisions actually taken.
        return self.score_parts(request, now).as_dict()

    def _on_popped(self, request: Request) -> None:
        """Explain the request whose turn it is (it may still fail to fit)."""
        self._admitting = request
        self._first_scan = True
        self._lower_key_floor(request)
        parts = self.explain(request, self._now)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("sla t=%.3f load=%.2f next %s: %s", self._now, self.load, request.request_id,
                         parts.as_dict())

    def _lower_key_floor(self, request: Request) -> None:
        _, key, cls, _ = self._static(request)
        if key < self._key_floor[cls]:
            self._key_floor[cls] = key

    def _running_score(self, request: Request, now: float) -> float:
        score = self._running_scores.get(request.request_id)
        if score is None:
            score = self._running_scores[request.request_id] = self.score(request, now)
        return score

    def _is_aged(self, request: Request, now: float) -> bool:
        return now - request.arrival_time >= self.config.max_wait

    # ------------------------------------------------------------ preemption

    def select_victim(self, running: Sequence[Request], now: float) -> Request:
        """The unprotected running request with the lowest score (then the latest arrival);
        aged ones (waited max_wait before running) only if all others are, protected ones last.

        While a waiting request is being admitted (it was just popped) the exact scores are
        skipped when a lower bound already shows that it can preempt nobody: a running request
        scores at least its static key plus its class's compensation plus, while decoding on
        time (its last token at most tpot_slo ago, no earlier deadline), the urgency at
        tpot_slo from the due time, 2 * sigmoid(-tpot_slo / window). First, without looking at
        the running requests, by the per-class key floor (one sum per class); then by a scan
        of them. The request returned then is one that may_preempt refuses, as it would refuse
        every other: with 256 running, a step that admits nobody costs the policy O(classes)."""
        admitting = self._admitting
        if admitting is not None and not self._is_aged(admitting, now):
            threshold = self._preempt_threshold(admitting, now)
            if self._running_floor(now) >= threshold:
                return running[0]
            # The scheduler's first call for an admission passes all running requests, later
            # ones what is left once victims are chosen (who stay running if room is not made).
            victim, bound = self._lowest_bound(running, reset_floor=self._first_scan)
            if self._first_scan:  # the request being admitted may join them
                self._first_scan = False
                self._lower_key_floor(admitting)
            if bound >= threshold:
                return victim
        return self._exact_victim(running, now)

    def head_may_preempt(self, waiting: RequestQueue, now: float) -> bool:
        """No, if even the per-class key floor of the running requests (select_victim's first
        bound) is not below the next request's score less the margin: then select_victim would
        return a request may_preempt refuses. Found without taking it off the queue, so a full
        batch costs a step the queue's walk only, not the pop, the victim search and the put
        back (with tenant fairness, a provisional charge taken back too)."""
        assert isinstance(waiting, SLAQueue), "the waiting queue must be one this policy made"
        request = waiting.peek()
        return self._is_aged(request, now) or self._running_floor(now) < self._preempt_threshold(request, now)

    def _preempt_threshold(self, request: Request, now: float) -> float:
        """A running request scoring at least this is not displaced by waiting `request` (not aged)."""
        return self.score(request, now) - self.config.preempt_margin + _BOUND_SLACK

    def _running_floor(self, now: float) -> float:
        """At most the score of every preemptible running request: the per-class key floor plus
        the class's compensation and the common aging term (urgency only adds)."""
        return min(map(operator.add, self._key_floor, self.fairness)) + self.config.aging_rate * now

    def _exact_victim(self, running: Sequence[Request], now: float) -> Request:
        """select_victim by every running request's score; while a request is being admitted,
        those its tenant may not displace (`_tenant_keeps`) after the others, as the scheduler
        stops at the first victim refused."""
        scores = self._running_scores
        self._score_running(running, now)
        k, max_wait = self.config.max_preemptions, self.config.max_wait
        admitting = self._admitting
        # (An aged request being admitted displaces by age alone: may_preempt skips the rule.)
        by_tenant = self.counters is not None and admitting is not None and not self._is_aged(admitting, now)
        victim = min(running, key=lambda r: (r.num_preemptions >= k, now - r.arrival_time >= max_wait,
                                             by_tenant and self._tenant_keeps(admitting, r),
                                             scores[r.request_id], -r.arrival_time, r.request_id))
        parts = self.explain(victim, now)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("sla t=%.3f victim %s: %s", now, victim.request_id, parts.as_dict())
        return victim

    def _static(self, r: Request) -> tuple[Request, float, int, float]:
        """(request, static_key, class, the urgency floor while decoding), cached per request."""
        static = self._statics.get(r.request_id)
        if static is None or static[0] is not r:
            cfg = self.config
            tpot = r.hints.tpot_slo
            floor = 2.0 * sigmoid(-tpot / cfg.time_window) if tpot is not None else 0.0
            static = self._statics[r.request_id] = (
                r, static_key(r, cfg), priority_class(r.priority, cfg.num_priority_classes), floor)
        return static

    def _lowest_bound(self, running: Sequence[Request], reset_floor: bool) -> tuple[Request, float]:
        """The running request with the lowest lower bound of its score now, among those a
        waiting request that is not aged may preempt (neither protected nor aged; with none,
        an infinite bound). With `reset_floor` (`running` is every running request) the
        per-class key floor becomes theirs."""
        cfg = self.config
        scale, fairness, statics = cfg.urgency_weight * self.load_adjustment, self.fairness, self._statics
        k = cfg.max_preemptions
        lowest, victim = math.inf, running[0]
        now = self._now
        max_wait = cfg.max_wait  # aged as _is_aged reads it (a horizon now - max_wait rounds otherwise)
        key_floor = [math.inf] * cfg.num_priority_classes if reset_floor else self._key_floor
        for r in running:
            if r.num_preemptions >= k or now - r.arrival_time >= max_wait:
                continue  # may_preempt refuses these
            static = statics.get(r.request_id)  # self._static(r), its hit inlined: once per running request
            if static is None or static[0] is not r:
                static = self._static(r)
            _, key, cls, floor = static
            if key < key_floor[cls]:
                key_floor[cls] = key
            bound = key + fairness[cls]
            if floor and r.first_token_time is not None:
                h = r.hints
                due = r.last_token_time + h.tpot_slo
                if due >= now and (h.deadline is None or r.arrival_time + h.deadline >= due):
                    bound += scale * floor  # |now - due| <= tpot_slo
            if bound < lowest:
                lowest, victim = bound, r
        self._key_floor = key_floor
        return victim, lowest + cfg.aging_rate * self._now

    def _score_running(self, running: Sequence[Request], now: float) -> None:
        """self.score() for every running request not yet scored this step, inlined."""
        cfg = self.config
        scores, static_of = self._running_scores, self._static
        scale, window, fairness = cfg.urgency_weight * self.load_adjustment, cfg.time_window, self.fairness
        common = cfg.aging_rate * now
        for r in running:
            rid = r.request_id
            if rid in scores:
                continue
            _, key, cls, _ = static_of(r)
            h = r.hints
            due = math.inf if h.deadline is None else r.arrival_time + h.deadline
            if r.first_token_time is None:
                if h.ttft_slo is not None:
                    due = min(due, r.arrival_time + h.ttft_slo)
            elif h.tpot_slo is not None:
                due = min(due, r.last_token_time + h.tpot_slo)
            score = key + common + fairness[cls]
            if due != math.inf:
                score += scale * 2.0 * sigmoid(-abs(now - due) / window)
            scores[rid] = score

    def may_admit(self, request: Request, num_new_tokens: int, num_computed_tokens: int,
                  step: StepTally, now: float) -> bool:
        # The SLO guard; a request that waited max_wait passes it (the wait bound).
        return (self.guard is None or self._is_aged(request, now)
                or self.guard.admits(request, num_new_tokens, num_computed_tokens, step))

    def may_overtake(self, request: Request, ahead: Request, now: float) -> bool:
        # Never past a higher class, an earlier SLO or deadline, an aged request (the wait
        # bound) or, with tenant fairness, another tenant; the rest of the score is size and age.
        cfg = self.config
        return (priority_class(request.priority, cfg.num_priority_classes)
                == priority_class(ahead.priority, cfg.num_priority_classes)
                and due_time(request) <= due_time(ahead) and not self._is_aged(ahead, now)
                and (self.counters is None or request.tenant == ahead.tenant))

    def may_preempt(self, waiting: Request, victim: Request, now: float) -> bool:
        if victim.num_preemptions >= self.config.max_preemptions:
            return False
        # The wait bound: an aged request displaces any younger unprotected one, and is
        # displaced by no younger one.
        if self._is_aged(waiting, now):
            return victim.arrival_time > waiting.arrival_time
        if self._is_aged(victim, now):
            return False
        # A request preempted before does not win its place back from its own class: each such
        # win is another request's lost work, and three of a kind in turn would form a cycle
        # that only max_preemptions ends (a less important victim it may still displace).
        same_class = (priority_class(waiting.priority, self.config.num_priority_classes)
                      == priority_class(victim.priority, self.config.num_priority_classes))
        if waiting.num_preemptions and same_class:
            return False
        if self._tenant_keeps(waiting, victim):
            return False
        return self.score(waiting, now) > self._running_score(victim, now) + self.config.preempt_margin

    def _tenant_keeps(self, waiting: Request, victim: Request) -> bool:
        """With tenant fairness the queue ranks a class's tenants by VTC before scores, and so
        does preemption: within a class, another tenant's request is displaced only for a tenant
        still behind it with this request's prompt counted (its provisional charge; else the two
        could take turns), and then by score as well."""
        if self.counters is None or waiting.tenant == victim.tenant:
            return False
        n = self.config.num_priority_classes
        if priority_class(waiting.priority, n) != priority_class(victim.priority, n):
            return False
        return not self.counters.counter(waiting.tenant) < self.counters.counter(victim.tenant)

    # ------------------------------------------------------------ feedback and shedding

    def end_step(self, now: float) -> None:
        if self.counters is not None:
            self.counters.drop_provisional()

    def on_step_served(self, served: Sequence[ServedRequest], now: float) -> None:
        n = self.config.num_priority_classes
        served_tokens, statics, deadlines = self._served, self._statics, self._deadline_entries
        rows, decode_requests, finished = served_parts(served)
        for request, num_computed, num_recomputed, _ in rows:
            served_tokens[priority_class(request.hints.priority, n)] += num_computed - num_recomputed
        # One token each, counted by priority in C: this runs for every decode row of every step.
        for priority, count in collections.Counter(map(_PRIORITY, decode_requests)).items():
            served_tokens[priority_class(priority, n)] += count
        for request in finished:
            # Its cached statics go with it: kept until the next prune, finished requests
            # (their token lists) would be freed a thousand at a time, and CPython's
            # collector counts allocations against frees only while its count is above
            # zero: freed in bulk they drive it into extra full collections.
            statics.pop(request.request_id, None)
            deadlines.pop(request.request_id, None)
        if self.counters is not None:
            self.counters.charge(served)

    def on_step_observed(self, observation: StepObservation) -> None:
        # The KV usage the load reads: taken from the observation the scheduler builds anyway
        # for this hook, rather than a new argument of begin_step (every policy's and the
        # scheduler loop's), since after the step's results it is the pool the next step starts from.
        self.kv_usage = observation.kv_cache_usage
        if self.config.step_time_correction:
            if self.guard is not None:
                self.guard.observe(observation)
            elif self.timing is not None:
                self.timing.observe(observation)

    def take_expired(self, now: float,
                     least_work: Callable[[Request], RemainingWork]) -> list[tuple[Request, str]]:
        cfg = self.config
        if not (cfg.drop_expired or cfg.drop_unmeetable):
            return []
        shed: list[tuple[Request, str]] = []
        ratio = self._unmeetable_ratio()
        # Before the step times are trusted the unlooked wait, untouched (each also has its
        # deadline in the heap, from its arrival): no pass over them per step.
        if self._unlooked and ratio is not None:
            unlooked, self._unlooked = self._unlooked, []
            looked: set[int] = set()  # a victim put back twice in one step (preempted, then passed over)
            for request in unlooked:
                if request.is_finished or id(request) in looked:
                    continue
                looked.add(id(request))
                self._look(request, now, ratio, least_work, shed)
        heap, entries = self._deadlines, self._deadline_entries
        due = []
        while heap and heap[0][0] <= now:
            _, seq, request_id = heapq.heappop(heap)
            entry = entries.get(request_id)
            if entry is None or entry[0] != seq:
                continue  # superseded by a later look, or finished
            if entry[2].is_finished:  # aborted (a served one left at its step's end)
                del entries[request_id]
            else:
                due.append(entry[2])
        for request in due:  # after the pops: a fresh key is never <= now, but floats round
            self._look(request, now, ratio, least_work, shed)
        if len(heap) > 2 * self._deadlines_kept + 64:  # finished and superseded entries, now and then
            live = [item for item in heap
                    if (e := entries.get(item[2])) is not None and e[0] == item[1] and not e[2].is_finished]
            heapq.heapify(live)
            self._deadlines = live
            self._deadline_entries = {item[2]: entries[item[2]] for item in live}
            self._deadlines_kept = len(live)
        return shed

    def _unmeetable_ratio(self) -> Optional[float]:
        """What the cost model's step times are scaled by when judging deadlines (None: not now)."""
        if not self.config.drop_unmeetable:
            return None
        if not self.config.step_time_correction:
            return 1.0  # the profile, of this machine (sla_score.py refuses the shipped one)
        assert self.timing is not None
        return self.timing.low_ratio

    def _push_deadline(self, request: Request, key: float) -> None:
        seq = next(self._seq)
        self._deadline_entries[request.request_id] = (seq, request.num_tokens - request.num_computed_tokens, request)
        heapq.heappush(self._deadlines, (key, seq, request.request_id))

    def _look(self, request: Request, now: float, ratio: Optional[float],
              least_work: Callable[[Request], RemainingWork], shed: list[tuple[Request, str]]) -> None:
        """Shed `request` if its deadline has passed or (with `ratio`) cannot be met, else push it
        back keyed by when that would change."""
        deadline = request.deadline
        assert deadline is not None
        left = deadline - now
        # Shed or re-keyed below: an entry it still has in the heap is no longer its own.
        self._deadline_entries.pop(request.request_id, None)
        if left <= 0:
            self.num_shed["expired"] += 1
            shed.append((request, f"deadline exceeded: the request's deadline of "
                                  f"{request.hints.deadline * 1000:.0f} ms passed "
                                  f"{-left * 1000:.0f} ms ago, before it finished"))
            return
        if ratio is None:
            self._push_deadline(request, deadline)
            return
        assert self.timing is not None
        work = least_work(request)
        predicted = ratio * self.timing.cost_model.least_service_seconds(work)
        need = self._margin * predicted
        if need > left:
            self.num_shed["unmeetable"] += 1
            more = work.num_samples - 1
            decodes = f" and {more} more token{'s' if more > 1 else ''}, a decode step each" if more else ""
            # One decimal, so that a need just over the time left does not print as a tie.
            shed.append((request, f"deadline cannot be met: needs at least {need * 1000:.1f} ms, "
                                  f"{left * 1000:.1f} ms left of its {request.hints.deadline * 1000:.0f} ms "
                                  f"deadline (estimated: {self._margin:g} x the step cost "
                                  f"model's {predicted * 1000:.1f} ms for its "
                                  f"{work.num_tokens - work.num_computed_tokens} tokens left to compute in "
                                  f"one step{decodes}, served alone)"))
            return
        self._push_deadline(request, deadline - need)

    def get_stats(self) -> dict[str, object]:
        stats: dict[str, object] = {
            "load": self.load, "queue_load": self.queue_load, "kv_load": self.kv_load,
            "load_adjustment": self.load_adjustment,
            "class_fairness": list(self.fairness),
            "class_served_share": _shares(self._served), "class_demand_share": _shares(self._demand),
            "scores": dict(self.explained),  # request id -> ScoreParts, the latest explained
        }
        if self.counters is not None:
            stats["tenant_counters"] = self.counters.snapshot()
        if self.config.drop_expired or self.config.drop_unmeetable:
            stats["deadline_shed"] = dict(self.num_shed)  # cumulative, by why
        if self.guard is not None:
            stats["slo_guard_refusals"] = self.guard.num_refused
            stats["slo_guard_step_time_ratio"] = self.guard.timing.ratio  # measured / predicted
        return stats


def _shares(values: list[float]) -> list[float]:
    total = sum(values)
    return [v / total if total > 0 else 0.0 for v in values]

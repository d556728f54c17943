"""The scheduler: one call decides one engine step.

There are no prefill and decode phases. Each step every chosen request gets a number of tokens
to compute (a prefill chunk or one decode token) within the step's limits (a token budget and a
sequence cap, from the batch controller): running requests first, then swapped-out ones whose
blocks fit back, then waiting ones in policy order. Time only enters as `now=` arguments, so
the simulator and the real engine make the same decisions.

A step is a transaction: every `schedule()` is followed by exactly one `update_from_output()`
(it ran) or `fail_step()` (it did not), and nothing else is scheduled in between.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional, Sequence, Union

from tokenweir.checks import is_finite_number
from tokenweir.config import CacheConfig, SchedulerConfig
from tokenweir.core.batch_control import BatchController, StepLimits, observe_step
from tokenweir.core.batch_controllers import create_batch_controller
from tokenweir.core.block_hash import BlockHasher
from tokenweir.core.composition import check_admission_order, create_admission_order
from tokenweir.core.cost_model import (RemainingWork, StepComposition, StepCostModel, StepTally, chunk_composition,
                                      load_cost_model)
from tokenweir.core.kv_cache_manager import EMPTY_BLOCKS, KVCacheBlocks, KVCacheManager, PrefixCacheStats, SwapPairs
from tokenweir.core.policies import SchedulingPolicy, StepServed, create_policy
from tokenweir.core.prefill_limits import PartialPrefillLimits, StepPrefills
from tokenweir.core.preemption import PREEMPTION_KINDS, PreemptionChooser
from tokenweir.request import Request, RequestStatus, SamplingParams

# Compared directly in the per-request loops (the property calls cost more than the loops' work).
_RUNNING, _FINISHED = RequestStatus.RUNNING, RequestStatus.FINISHED_STOPPED  # every status from it on is final
# get_stats(now) explains this many of the longest-waiting requests: few, as it is read after
# every step (and the engine process ships it to the server's).
_LONGEST_WAITING = 4


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has no state for: first admission, or resumption after a preemption
    (then `token_ids` includes the outputs generated so far; after a swap, `num_computed_tokens`
    are the tokens whose K/V `blocks_to_swap_in` brings back)."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hit: these tokens' K/V are already in the cache
    sampling_params: SamplingParams
    kv_int8: bool = False  # its blocks hold int8 K/V (KVCacheManager.int8_block_size tokens each)


@dataclass(slots=True)
class CachedRequestData:
    """The scheduled requests the runner already holds, a column each (a record per request
    per step would be built for every decode row); only their newly allocated blocks are sent."""

    req_ids: list[str] = field(default_factory=list)
    # () where the step allocated none (most decode steps): one shared immutable empty value, as
    # a fresh list per request per step would be garbage the collector keeps sweeping.
    new_block_ids: list[Sequence[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    def rows(self) -> Iterator[tuple[str, Sequence[int], int]]:
        """(request id, new block ids, computed tokens) of each request."""
        return zip(self.req_ids, self.new_block_ids, self.num_computed_tokens)


@dataclass
class SchedulerOutput:
    step_id: int
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # request id -> tokens to compute this step
    total_num_scheduled_tokens: int
    # Request id -> computed tokens before its chunk, of the prefill (or recompute) chunks only
    # (what a cost model needs of them: a chunk deep in a long prompt reads far more K/V than
    # one at its start); every other scheduled request is a decode row.
    prefill_num_computed_tokens: dict[str, int]
    preempted_req_ids: set[str]  # the runner drops their state (swapped ones too)
    finished_req_ids: set[str]  # finished or aborted since the previous step
    # Swap preemption: (device block id, host block id) pairs, in both lists. The runner copies
    # out before the forward pass (the freed device blocks may be written in this step) and in
    # before attention reads; a step never has both.
    blocks_to_swap_out: SwapPairs = field(default_factory=list)
    blocks_to_swap_in: SwapPairs = field(default_factory=list)


@dataclass(slots=True)
class RequestUpdate:
    """What one step changed for a request: the tokens it gained (status is on the request)."""

    request: Request
    # Read-only: the caller's sampled list itself when all of it was taken (most steps), as a
    # copy per request per step is garbage that drives the collector into full passes.
    new_token_ids: list[int]


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float  # 0..1
    num_preemptions: int  # cumulative
    prefix_cache: PrefixCacheStats  # cumulative
    policy: dict[str, object] = field(default_factory=dict)  # the policy's own state (get_stats)
    num_preemptions_by_mode: dict[str, int] = field(default_factory=dict)  # cumulative, "recompute" | "swap"
    num_blocks_swapped_out: int = 0  # cumulative copies
    num_blocks_swapped_in: int = 0
    swap_space_usage: Optional[float] = None  # 0..1 of the host tier; None without one
    batch_controller: str = "static"
    batch_limits: Optional[StepLimits] = None  # of the latest step; None before the first
    batch_control: dict[str, object] = field(default_factory=dict)  # the controller's own state (get_stats)
    # Request id -> explain_request, with `now` and a policy that scores, of the longest-waiting
    # requests not running (waiting, preempted, swapped out), oldest first: so one starving in
    # the queue shows before its turn comes.
    longest_waiting: dict[str, dict[str, object]] = field(default_factory=dict)
    num_running_kv_int8: int = 0  # running requests whose K/V are int8 (low priority)


def _take_share(tally: StepTally, request: Request, num_scheduled: int, prefill_computed: Optional[int]) -> None:
    """Take a request's share of the step out of `tally`: its decode row (`prefill_computed`
    None), or its chunk of `num_scheduled` tokens after `prefill_computed`."""
    if prefill_computed is None:
        tally.num_decode_seqs -= 1
        tally.decode_context_tokens -= request.num_computed_tokens + 1
    else:
        tally.add(chunk_composition(num_scheduled, prefill_computed, request.num_tokens,
                                    request.num_prompt_tokens), -1)


@dataclass(slots=True)
class _StepState:
    """Bookkeeping of the step being built, so a preemption can undo a victim's share."""

    limits: StepLimits
    budget: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    prefill_computed: dict[str, int] = field(default_factory=dict)  # SchedulerOutput.prefill_num_computed_tokens
    tally: StepTally = field(default_factory=StepTally)  # the composition of what is scheduled so far
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    admitted: set[str] = field(default_factory=set)
    preempted: set[str] = field(default_factory=set)
    swapped_out: list[Request] = field(default_factory=list)
    blocks_to_swap_out: SwapPairs = field(default_factory=list)
    blocks_to_swap_in: SwapPairs = field(default_factory=list)
    prefills: Optional[StepPrefills] = None  # with max_num_partial_prefills > 1
    held_back: bool = False  # the policy (or the batch controller's cut) held an admission back: no more this step
    swap_held: bool = False  # ... or a swap-in


@dataclass
class _InFlight:
    """The step scheduled and not yet applied or failed: the very Request objects it scheduled,
    so that a request aborted and re-added under the same id is never credited with them."""

    step_id: int
    requests: dict[str, Request]
    swapped_out: list[Request]  # their K/V exist only if the step's copies ran
    tally: StepTally  # what it computes: the observation's composition when its results come back


class Scheduler:
    """Parts are injectable (defaults from the configs): the policy, the KV cache manager, the
    batch controller that sets each step's limits, and the cost model that `auto` preemption
    prices victims with (default: the shipped profile; the engine passes one whose swap term is
    this device's measured copy bandwidth)."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, *,
                 policy: Optional[SchedulingPolicy] = None,
                 kv_cache_manager: Optional[KVCacheManager] = None,
                 batch_controller: Optional[BatchController] = None,
                 cost_model: Optional[StepCostModel] = None) -> None:
        self.config = scheduler_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.kv_cache_manager = kv_cache_manager or KVCacheManager(
            num_blocks=cache_config.num_blocks, block_size=cache_config.block_size,
            enable_caching=cache_config.enable_prefix_caching,
            watermark_blocks=cache_config.watermark_blocks,
            hasher=BlockHasher(cache_config.prefix_cache_hash_key),
            num_host_blocks=cache_config.num_host_blocks, int8_block_size=cache_config.int8_block_size,
            int8_min_priority=cache_config.int8_kv_min_priority)
        if cost_model is None and cache_config.preemption_mode == "auto":
            cost_model = load_cost_model(None)
        self.preemption = PreemptionChooser(cache_config.preemption_mode, self.kv_cache_manager,
                                            cost_model, cache_config.kv_block_bytes)
        self.policy = policy or create_policy(scheduler_config.policy, scheduler_config.policy_config)
        # The feedback columns are a noticeable share of a decode step's cost: fill them only
        # for a policy that reads them.
        self._policy_wants_feedback = type(self.policy).on_step_served is not SchedulingPolicy.on_step_served
        # Likewise the search for victims on admission, for a policy that never lets a waiting
        # request preempt (fcfs, vtc): it would be refused victim after victim.
        self._policy_preempts = type(self.policy).may_preempt is not SchedulingPolicy.may_preempt
        self.batch_controller = batch_controller or create_batch_controller(
            scheduler_config.batch_controller, scheduler_config.batch_control_config,
            StepLimits(scheduler_config.max_num_batched_tokens, scheduler_config.max_num_seqs),
            cost_model=cost_model, watermark=cache_config.watermark)
        # Only a controller that adapts is told what each step did (it costs a pass over the step).
        self._controller_observes = type(self.batch_controller).on_step is not BatchController.on_step
        self._controller_begins = type(self.batch_controller).begin_step is not BatchController.begin_step
        # ... and only one that cuts prefill chunks is asked about each (chunked prefill only: a
        # whole prompt must otherwise go in one step).
        self._controller_cuts = (scheduler_config.enable_chunked_prefill
                                 and type(self.batch_controller).cut_chunk is not BatchController.cut_chunk)
        # ... and a policy that reads it (sla's SLO guard corrects its step times by it): one
        # observation per step, for both.
        self._policy_observes = type(self.policy).on_step_observed is not SchedulingPolicy.on_step_observed
        self.step_limits: Optional[StepLimits] = None  # of the latest step, for the stats
        self.prefill_limits = PartialPrefillLimits.from_config(scheduler_config)
        self.waiting = self.policy.make_waiting_queue()
        check_admission_order(scheduler_config.composition, self.policy.name, cache_config.enable_prefix_caching)
        self.admission_order = create_admission_order(scheduler_config.composition, self.kv_cache_manager,
                                                      self.waiting)
        self.swapped = self.policy.make_waiting_queue()  # swapped out, in the policy's order
        self.running: list[Request] = []  # admission order
        self.requests: dict[str, Request] = {}  # every unfinished request
        self._finished_req_ids: set[str] = set()
        self._step_ids = itertools.count()
        self._in_flight: Optional[_InFlight] = None
        self.num_preemptions = 0
        self.num_preemptions_by_mode = dict.fromkeys(PREEMPTION_KINDS, 0)
        self.num_blocks_swapped_out = self.num_blocks_swapped_in = 0
        # A request can never outgrow the pool, nor (without chunking) the step budget.
        limits = [cache_config.num_blocks * cache_config.block_size]
        if scheduler_config.max_model_len is not None:
            limits.append(scheduler_config.max_model_len)
        if not scheduler_config.enable_chunked_prefill:
            limits.append(scheduler_config.max_num_batched_tokens)
        self.max_model_len = min(limits)

    # ------------------------------------------------------------------ requests in and out

    def add_request(self, request: Request) -> None:
        """Queue a request. One whose prompt can never fit finishes at once as FINISHED_IGNORED
        (with `status_message` saying why) rather than blocking the queue behind it."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if (request.status is not RequestStatus.WAITING or request.num_computed_tokens
                or request.num_output_tokens != request.num_restored_output_tokens):
            # A request object that ran before (aborted, finished) carries its progress: a new one must be
            # built. Outputs restored from another engine (failover) are the one progress it may arrive with.
            raise ValueError(f"request {request.request_id!r} has been scheduled before ({request.status.name}, "
                             f"{request.num_computed_tokens} tokens computed): add a new Request")
        if request.num_prompt_tokens > self.max_model_len:
            request.status = RequestStatus.FINISHED_IGNORED
            request.finished_time = request.arrival_time
            request.status_message = (
                f"prompt has {request.num_prompt_tokens} tokens, more than the {self.max_model_len} "
                f"a request may hold ({self._describe_max_len()})")
            return
        request.status = RequestStatus.WAITING
        request.max_num_tokens = min(request.max_num_tokens, self.max_model_len)
        self.kv_cache_manager.assign_kv_dtype(request)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def _describe_max_len(self) -> str:
        parts = [f"KV pool {self.cache_config.num_blocks} blocks x {self.block_size}"]
        if self.config.max_model_len is not None:
            parts.append(f"max_model_len {self.config.max_model_len}")
        if not self.config.enable_chunked_prefill:
            parts.append(f"max_num_batched_tokens {self.config.max_num_batched_tokens} without chunked prefill")
        return ", ".join(parts)

    def abort_requests(self, request_ids: Union[str, Iterable[str]], now: float = 0.0) -> None:
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED, now)

    def finish_requests(self, request_ids: Union[str, Iterable[str]], status: RequestStatus,
                        now: float = 0.0) -> None:
        """Finish requests (one id, or several) from outside the step (abort; a stop string
        matched on detokenized text) in whatever state they are. Unknown or already finished ids
        are ignored: a client may abort a request that has just completed."""
        if not isinstance(status, RequestStatus) or not status.is_finished:
            raise ValueError(f"finish_requests needs a finished status, got {status!r}")
        if isinstance(request_ids, str):  # one id, not its characters
            request_ids = (request_ids,)
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status == RequestStatus.SWAPPED:
                self.swapped.remove(request)
            else:
                self.waiting.remove(request)
                self.admission_order.forget(request)
            self._finish(request, status, now)

    def _finish(self, request: Request, status: RequestStatus, now: float) -> None:
        """Terminal bookkeeping (both tiers' blocks are freed); the caller has already taken it
        out of its queue."""
        request.status = status
        request.finished_time = now
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._finished_req_ids.add(request.request_id)

    def take_finished_req_ids(self) -> set[str]:
        """The requests finished since the last step, which the next SchedulerOutput would have
        reported; for a caller that tells the runner itself (the engine, when it goes idle)."""
        finished, self._finished_req_ids = self._finished_req_ids, set()
        return finished

    @property
    def step_in_flight(self) -> Optional[int]:
        """The id of the step scheduled and not yet settled, if any."""
        return None if self._in_flight is None else self._in_flight.step_id

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def reset_prefix_cache(self) -> None:
        self.kv_cache_manager.reset_prefix_cache()

    def explain_request(self, request_id: str, now: float) -> Optional[dict[str, object]]:
        """The terms of the policy's rank of an unfinished request at `now` (sla: its score
        parts, ScoreParts' fields) with its `status` (WAITING, RUNNING, PREEMPTED or SWAPPED);
        None under a policy that ranks by no score. Read-only. An id that is not unfinished here
        (never added, or finished) raises KeyError: None already means "no score"."""
        request = self.requests.get(request_id)
        if request is None:
            raise KeyError(f"no unfinished request {request_id!r} in the scheduler (never added, or finished)")
        parts = self.policy.explain_request(request, now)
        if parts is not None:
            parts["status"] = request.status.name
        return parts

    def _explain_longest_waiting(self, now: float) -> dict[str, dict[str, object]]:
        # `requests` is in the order they were added (arrival order, in the engine and the
        # simulator): the first ones not running are the longest waiting. The walk passes at
        # most the running requests older than them.
        explained: dict[str, dict[str, object]] = {}
        if type(self.policy).explain_request is SchedulingPolicy.explain_request:
            return explained
        for request in self.requests.values():
            if request.status is not _RUNNING:
                parts = self.policy.explain_request(request, now)
                if parts is None:
                    break  # it ranks by no score
                parts["status"] = request.status.name
                explained[request.request_id] = parts
                if len(explained) == _LONGEST_WAITING:
                    break
        return explained

    def get_stats(self, now: Optional[float] = None) -> SchedulerStats:
        """With `now`, also the policy's explanation of the longest-waiting requests."""
        kv = self.kv_cache_manager
        return SchedulerStats(num_running=len(self.running), num_waiting=len(self.waiting),
                              num_swapped=len(self.swapped), kv_cache_usage=kv.get_usage(),
                              num_preemptions=self.num_preemptions,
                              prefix_cache=PrefixCacheStats(**vars(kv.prefix_cache_stats)),
                              policy=self.policy.get_stats(),
                              num_preemptions_by_mode=dict(self.num_preemptions_by_mode),
                              num_blocks_swapped_out=self.num_blocks_swapped_out,
                              num_blocks_swapped_in=self.num_blocks_swapped_in,
                              swap_space_usage=kv.get_host_usage(),
                              batch_controller=self.batch_controller.name, batch_limits=self.step_limits,
                              batch_control=self.batch_controller.get_stats(),
                              longest_waiting={} if now is None else self._explain_longest_waiting(now),
                              num_running_kv_int8=sum(r.kv_int8 for r in self.running)
                              if kv.int8_min_priority is not None else 0)

    def least_remaining_work(self, request: Request) -> RemainingWork:
        """The least an unfinished request still needs before it can finish. Computed tokens: a
        running or swapped-out request's own; a waiting one's prefix-cache hit now (tokens that
        others compute for it later are still computed in some step before it ends). Tokens to
        sample: it may stop at the first past min_tokens (EOS, a stop id or string), unless it
        ignores EOS and has no stop ids or strings, when it runs to max_tokens
        (`Request.least_num_output_tokens`, within max_model_len); at least one."""
        if request.status is _RUNNING or request.status == RequestStatus.SWAPPED:
            computed = request.num_computed_tokens
        else:
            computed = self.kv_cache_manager.get_computed_blocks(request)[1]
        num_tokens = request.num_tokens
        samples = max(1, request.least_num_output_tokens - request.num_output_tokens)
        return RemainingWork(num_tokens, request.num_prompt_tokens, computed, samples)

    # ------------------------------------------------------------------ one step

    def schedule(self, now: float = 0.0) -> SchedulerOutput:
        if not is_finite_number(now):  # every policy and controller reads it
            raise ValueError(f"now must be a finite number of seconds, got {now!r}")
        if self._in_flight is not None:
            raise RuntimeError(f"step {self._in_flight.step_id} was neither applied (update_from_output) "
                               "nor failed (fail_step): a step's results must be settled before the next")
        limits = self._get_limits(now)
        step = _StepState(limits=limits, budget=limits.max_num_batched_tokens)
        if self.prefill_limits is not None:
            step.prefills = self.prefill_limits.begin_step(self.policy, now)
        self.policy.begin_step(now, self.waiting, self.running)
        self.admission_order.begin_step(now, self.running)
        for request, reason in self.policy.take_expired(now, self.least_remaining_work):  # overload shedding (sla)
            request.status_message = reason
            self.finish_requests([request.request_id], RequestStatus.FINISHED_ABORTED, now)

        # 1. Running requests keep their place; each continues its prefill or decodes a token.
        # A decode row whose last block has room (most rows of most steps) is booked here, its
        # tally counted locally and added once: the general path is a call per row.
        allocate, num_scheduled = self.kv_cache_manager.allocate_slots, step.num_scheduled
        num_decode = decode_context = 0
        running = list(self.running)
        for index, request in enumerate(running):
            if step.budget == 0:
                break
            if request.status is not _RUNNING:
                continue  # preempted earlier in this step to make room for another
            computed = request.num_computed_tokens
            remaining = num_new = len(request.all_token_ids) - computed
            if num_new > 1:  # a prefill chunk (a decode's one token fits any budget left)
                num_new = self._cap_tokens(num_new, step.budget)
                if self._controller_cuts:
                    # The rows booked locally so far are not in the tally yet; those after it
                    # in `running` are still to come.
                    num_new = self._cut_chunk(request, num_new, computed, step, num_decode, decode_context,
                                              len(running) - index - 1)
                    if num_new == 0:
                        # It goes on in a later step, still a partial prefill: it keeps its
                        # slots, or admissions would start more than the limits allow.
                        if step.prefills is not None:
                            step.prefills.add(request, 0)
                        continue
            blocks = allocate(request, num_new)
            if blocks is EMPTY_BLOCKS and remaining == 1 and request.output_token_ids:
                num_scheduled[request.request_id] = 1
                step.budget -= 1
                num_decode += 1
                decode_context += computed + 1
                continue
            if blocks is None:
                blocks = self._allocate_or_preempt(request, num_new, step, now)
                if blocks is None:
                    continue  # it was preempted itself
            self._schedule_tokens(request, num_new, remaining, blocks, step)
        # A decode row preempted later in the loop was taken out of the tally already.
        step.tally.num_decode_seqs += num_decode
        step.tally.decode_context_tokens += decode_context

        # 2. Swapped-out requests come back when their blocks fit, but never in a step that
        # swapped out: its copies out and in could overwrite each other's blocks.
        if not step.blocks_to_swap_out:
            self._swap_in(step, now)

        # 3. Waiting requests, in policy order (within a band, the admission order's), while
        # budget, sequence slots and blocks last. One that cannot be admitted now keeps its place;
        # the policy says how many may pass it. None passes a request swapped out before it
        # arrived, which would otherwise wait for good.
        passed_over: list[Request] = []
        lookahead = self.policy.admission_lookahead()
        while self.waiting and step.budget > 0:
            batch_full = len(self.running) >= limits.max_num_seqs
            if batch_full and not self.policy.head_may_preempt(self.waiting, now):
                break  # it could only preempt, and the policy shows it cannot
            # Off the queue while deciding: a victim preempted to make room for it goes back to
            # the queue's front, and must not be mistaken for it.
            request = self.admission_order.pop(batch_full)
            if not self._swapped_before(request, step) and self._try_admit(request, step, now):
                continue
            passed_over.append(request)
            if step.held_back:
                break  # the policy holds the rest back for this step
            if step.prefills is not None and step.prefills.was_passed(request):
                continue  # it waits for a long-prefill slot; shorter prompts may pass it
            if len(passed_over) > lookahead or len(self.running) >= limits.max_num_seqs:
                break
        for request in reversed(passed_over):
            self.waiting.push_front(request)
        if step.prefills is not None:
            self._top_up(step)
        self.policy.end_step(now)
        return self._make_output(step)

    def _get_limits(self, now: float) -> StepLimits:
        if self._controller_begins:
            self.batch_controller.begin_step(now, self.running)
        limits = self.batch_controller.get_limits(now)
        if (limits.max_num_batched_tokens > self.config.max_num_batched_tokens
                or limits.max_num_seqs > self.config.max_num_seqs):
            raise ValueError(f"the batch controller's {limits} exceed the configured maxima "
                             f"(max_num_batched_tokens={self.config.max_num_batched_tokens}, "
                             f"max_num_seqs={self.config.max_num_seqs})")
        self.step_limits = limits
        return limits

    def _swapped_before(self, request: Request, step: _StepState) -> bool:
        """Whether a request that arrived no later than `request` is swapped out. Not once the
        policy held a swap-in back this step: then each waiting request gets the policy's own
        verdict, and a swapped-out one cannot hold back more important arrivals."""
        return not step.swap_held and any(r.arrival_time <= request.arrival_time for r in self.swapped)

    def _swap_in(self, step: _StepState, now: float) -> None:
        """Bring swapped-out requests back in policy order, each with its next tokens, while
        their blocks fit above the watermark; the first that does not fit stops the pass."""
        while self.swapped and step.budget > 0 and len(self.running) < step.limits.max_num_seqs:
            request = self.swapped.pop()
            num_new = request.num_tokens - request.num_computed_tokens
            pairs = None
            if self.config.enable_chunked_prefill or num_new <= step.budget:
                num_new = self._cap_tokens(num_new, step.budget)
                if self._controller_cuts and num_new > 1:
                    num_new = self._cut_chunk(request, num_new, request.num_computed_tokens, step)
                if num_new == 0:
                    pass  # the controller's cut left its chunk no room in this step
                elif not self.policy.may_admit(request, num_new, request.num_computed_tokens, step.tally, now):
                    step.swap_held = True
                elif step.prefills is None or step.prefills.admits(  # (the chunk as cut: it may be partial)
                        request, request.num_tokens - request.num_computed_tokens, num_new):
                    # As for an admission: the reserve holds unless nothing else runs.
                    pairs = self.kv_cache_manager.swap_in(request, num_new, apply_watermark=bool(self.running))
            if pairs is None:
                self.swapped.push_front(request)
                return
            step.blocks_to_swap_in.extend(pairs)
            self.num_blocks_swapped_in += len(pairs)
            self._admit(request, request.num_computed_tokens, now, step)
            self._schedule_tokens(request, num_new, request.num_tokens - request.num_computed_tokens, EMPTY_BLOCKS, step)

    def _try_admit(self, request: Request, step: _StepState, now: float) -> bool:
        """Admit a waiting request and schedule its first chunk; False, with nothing changed,
        if it cannot run now."""
        if request.request_id in step.preempted:
            return False  # preempted in this step: re-admitting it would undo the room just made
        computed, num_hit = self.kv_cache_manager.get_computed_blocks(request)
        num_new = request.num_tokens - num_hit
        if not self.config.enable_chunked_prefill and num_new > step.budget:
            return False  # the whole prompt must go in one step: wait for room
        if step.prefills is not None and not step.prefills.admits(request, num_new, step.budget):
            return False
        num_new = self._cap_tokens(num_new, step.budget)
        cuts = self._controller_cuts and num_new > 1
        chunk = self._cut_chunk(request, num_new, num_hit, step) if cuts else num_new
        victims = self._plan_preemptions(request, chunk or num_new, computed, num_hit, step, now)
        if victims is None:
            step.held_back = step.held_back or chunk == 0  # (as below: no chunk fits beside the step's)
            return False
        if cuts:
            if victims:
                # Beside the step as it will be: a victim's chunk leaves with it (a more important
                # request displacing a running prompt takes the room that prompt's chunk held).
                chunk = self._cut_chunk(request, num_new, num_hit, step, freeing=victims)
            num_new = chunk
            if num_new == 0:
                step.held_back = True  # no chunk fits beside the step's: no more admissions
                return False
            # A prompt that fits the budget asked for no partial slot; cut short, it takes one.
            if (step.prefills is not None and num_new < request.num_tokens - num_hit
                    and not step.prefills.admits(request, request.num_tokens - num_hit, num_new)):
                return False
        if not self.policy.may_admit(request, num_new, num_hit, step.tally, now):
            step.held_back = True
            return False
        for victim in victims:
            self._preempt(victim, step)
        # An admission that preempted takes what its victims freed, the reserve included (see
        # _plan_preemptions); otherwise it must leave the watermark free while others run.
        blocks = self.kv_cache_manager.allocate_slots(
            request, num_new, computed, num_hit, apply_watermark=not victims and bool(self.running))
        if blocks is None:
            raise RuntimeError(f"admitting {request.request_id!r} failed after its room was planned")
        self.kv_cache_manager.record_prefix_lookup(request, num_hit)
        self._admit(request, num_hit, now, step)
        self._schedule_tokens(request, num_new, request.num_tokens - num_hit, blocks, step)
        return True

    def _plan_preemptions(self, request: Request, num_new: int, computed: KVCacheBlocks, num_hit: int,
                          step: _StepState, now: float) -> Optional[list[Request]]:
        """The running requests to preempt so that a waiting request can be admitted: [] when it
        fits as things are, None when it cannot be admitted this step. Nothing is preempted
        unless that makes room: victims come in the policy's order, each one the policy lets
        `request` displace, and only as many as its sequence slot and blocks need.

        The watermark never causes a preemption: it is a reserve for the running requests'
        growth, so a request that fits into the free blocks only by using the reserve waits.
        Once a request must preempt anyway, it takes what its victims free.
        """
        kv = self.kv_cache_manager
        # The step's cap holds whatever the policy, a cap an adaptive batch controller lowered
        # as much as the configured one: at a full cap a request may only displace one running
        # request for its slot (one for one, as at a static cap: the policy's preemption, which
        # neither grows the batch nor shrinks it; more victims only if its blocks need them). A
        # cap lowered below the running count is full too, and an admission still needs one
        # victim for its slot, never more: the batch shrinks to the cap only as requests finish
        # (by admitting less, never by preempting).
        needs_slot = len(self.running) >= step.limits.max_num_seqs
        slots = max(step.limits.max_num_seqs, len(self.running))
        if not needs_slot:
            if kv.can_allocate(request, num_new, computed, num_hit, apply_watermark=bool(self.running)):
                return []
            if kv.can_allocate(request, num_new, computed, num_hit):
                return None  # only the reserve is short
        if not self._policy_preempts:
            return None
        # Victims must make room for the whole prompt, not only its first chunk: otherwise the
        # next chunks find the blocks taken (by a victim re-admitted, or by running growth) and
        # the request preempts again, or preempts itself, for nothing.
        num_whole = request.num_tokens - num_hit
        victims: list[Request] = []
        candidates = list(self.running)
        while candidates:
            victim = self.policy.select_victim(candidates, now)
            if not (self.policy.may_preempt(request, victim, now)
                    and self.admission_order.may_preempt(request, victim)):
                return None
            candidates.remove(victim)
            victims.append(victim)
            if (len(self.running) - len(victims) < slots
                    and kv.can_allocate(request, num_whole, computed, num_hit, freeing=victims)):
                return victims
        return None

    def _cap_tokens(self, num_tokens: int, budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if threshold and num_tokens > threshold:
            num_tokens = threshold
        return min(num_tokens, budget)

    def _cut_chunk(self, request: Request, num_new: int, computed: int, step: _StepState, num_decode: int = 0,
                   decode_context: int = 0, pending_rows: int = 0, freeing: Sequence[Request] = ()) -> int:
        """The batch controller's cut of a prefill chunk of `num_new` tokens after `computed`;
        `num_decode` decode rows (reading `decode_context` tokens) are booked but not yet in the
        step's tally; the shares of the `freeing` victims (to be preempted) are left out."""
        tally = step.tally
        if freeing:
            tally = dataclasses.replace(tally)
            for victim in freeing:
                num_scheduled = step.num_scheduled.get(victim.request_id, 0)
                if num_scheduled:
                    _take_share(tally, victim, num_scheduled, step.prefill_computed.get(victim.request_id))
        comp = tally.composition()
        if num_decode:
            comp += StepComposition(num_decode_seqs=num_decode, decode_context_tokens=decode_context,
                                    num_sampled=num_decode)
        return self.batch_controller.cut_chunk(num_new, computed, request.num_tokens, request.num_prompt_tokens,
                                               comp, pending_rows)

    def _allocate_or_preempt(self, request: Request, num_new: int, step: _StepState,
                             now: float) -> Optional[KVCacheBlocks]:
        """Blocks for `num_new` more tokens of a running request that do not fit as things
        are, preempting victims in policy order until they fit or the request itself is the
        victim (then None)."""
        while True:
            victim = self.policy.select_victim(self.running, now)
            self._preempt(victim, step)
            if victim is request:
                return None
            blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            if blocks is not None:
                return blocks

    def _preempt(self, victim: Request, step: _StepState) -> None:
        """Swap the victim out (its computed K/V to host blocks, to the swapped queue) or
        recompute it (blocks freed, back to the front of waiting), as the preemption mode
        chooses; either way its device blocks are free at once. If it was already given tokens
        this step, hand them back to the budget (and take its share out of the step's tally,
        before a recompute resets its computed tokens)."""
        rid = victim.request_id
        num_scheduled = step.num_scheduled.pop(rid, 0)
        if num_scheduled:
            _take_share(step.tally, victim, num_scheduled, step.prefill_computed.pop(rid, None))
            step.budget += num_scheduled
        self.running.remove(victim)
        kind = self.preemption.choose(victim, may_swap=not step.blocks_to_swap_in)
        if kind == "swap":
            pairs = self.kv_cache_manager.swap_out(victim)
            step.blocks_to_swap_out.extend(pairs)
            step.swapped_out.append(victim)
            self.num_blocks_swapped_out += len(pairs)
            victim.status = RequestStatus.SWAPPED
            # To the front, as recompute victims go back to waiting: victims are taken latest
            # first, so an FCFS queue stays in arrival order.
            self.swapped.push_front(victim)
        else:
            self._send_back_to_wait(victim)
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.num_preemptions_by_mode[kind] += 1
        step.preempted.add(rid)
        if step.prefills is not None:
            step.prefills.remove(rid)
        # Its block ids and admission need no undoing: the output is built from `running`.

    def _send_back_to_wait(self, request: Request) -> None:
        """Recompute preemption: free its blocks (both tiers), to the front of waiting."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.push_front(request)

    def _admit(self, request: Request, num_hit: int, now: float, step: _StepState) -> None:
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now
        self.running.append(request)
        step.admitted.add(request.request_id)

    @staticmethod
    def _schedule_tokens(request: Request, num_new: int, remaining: int, blocks: KVCacheBlocks,
                         step: _StepState) -> None:
        """`num_new` of the `remaining` tokens the request has yet to compute."""
        step.num_scheduled[request.request_id] = num_new
        step.budget -= num_new
        if blocks is not EMPTY_BLOCKS:  # the manager hands out EMPTY_BLOCKS for "no new block"
            step.new_block_ids[request.request_id] = blocks.get_block_ids()
        # A decode row has one token left and an output already (without one, that token is
        # the prompt's last): two tests, as cheap as the one a decode paid before.
        computed = request.num_computed_tokens
        if remaining > 1 or not request.output_token_ids:
            step.prefill_computed[request.request_id] = computed
            step.tally.add(chunk_composition(num_new, computed, computed + remaining, request.num_prompt_tokens))
            if step.prefills is not None and remaining > 1:
                step.prefills.add(request, num_new)
        else:  # the tally's decode row, inline (StepTally): this runs for every running request
            tally = step.tally
            tally.num_decode_seqs += 1
            tally.decode_context_tokens += computed + 1

    def _top_up(self, step: _StepState) -> None:
        """What the step has left goes to its long prefills, which the threshold capped, in
        the order they were scheduled, as far as blocks allow above the admission reserve
        (never by preempting)."""
        assert step.prefills is not None
        for request_id in step.prefills.capped():
            if step.budget == 0:
                return
            request = self.requests[request_id]
            num_scheduled = step.num_scheduled.get(request_id, 0)
            if not num_scheduled:
                continue  # the controller's cut held its chunk back (it only keeps its slots)
            extra = min(request.num_tokens - request.num_computed_tokens - num_scheduled, step.budget)
            computed, total = request.num_computed_tokens, request.num_tokens
            own = chunk_composition(num_scheduled, computed, total, request.num_prompt_tokens)
            if self._controller_cuts:  # the chunk as it would grow, beside the rest of the step
                step.tally.add(own, -1)
                allowed = self.batch_controller.cut_chunk(num_scheduled + extra, computed, total,
                                                          request.num_prompt_tokens, step.tally.composition(), 0)
                step.tally.add(own)
                extra = min(extra, allowed - num_scheduled)
                if extra <= 0:
                    continue
            blocks = self.kv_cache_manager.allocate_slots(request, num_scheduled + extra, apply_watermark=True)
            if blocks is None:
                continue
            step.tally.add(own, -1)
            step.tally.add(chunk_composition(num_scheduled + extra, computed, total, request.num_prompt_tokens))
            step.num_scheduled[request_id] = num_scheduled + extra
            step.budget -= extra
            if blocks is not EMPTY_BLOCKS:
                step.new_block_ids.setdefault(request_id, []).extend(blocks.get_block_ids())

    def _make_output(self, step: _StepState) -> SchedulerOutput:
        new_reqs: list[NewRequestData] = []
        cached_reqs = CachedRequestData()
        add_cached, add_new_blocks = cached_reqs.req_ids.append, cached_reqs.new_block_ids.append
        add_computed = cached_reqs.num_computed_tokens.append
        num_scheduled, admitted, new_block_ids = step.num_scheduled, step.admitted, step.new_block_ids
        # The very Request objects scheduled, in scheduling order (which is running order).
        scheduled: dict[str, Request] = {}
        for request in self.running:  # running order is the runner's batch order
            rid = request.request_id
            if rid not in num_scheduled:
                continue
            scheduled[rid] = request
            if admitted and rid in admitted:
                new_reqs.append(NewRequestData(
                    request_id=rid, token_ids=list(request.all_token_ids),
                    num_prompt_tokens=request.num_prompt_tokens,
                    block_ids=self.kv_cache_manager.get_block_ids(rid),
                    num_computed_tokens=request.num_computed_tokens,
                    sampling_params=request.sampling_params, kv_int8=request.kv_int8))
            else:
                add_cached(rid)
                add_new_blocks(new_block_ids.get(rid, ()))
                add_computed(request.num_computed_tokens)
        # Checked for real (not an assert, which `python -O` drops): a runner handed more than
        # the budget may run out of activation memory.
        # A step's lower sequence cap only holds back admissions, so the configured one bounds
        # the requests of a step.
        limits = step.limits
        if step.budget < 0 or len(step.num_scheduled) > self.config.max_num_seqs:
            raise RuntimeError(f"step overspent its limits: {limits.max_num_batched_tokens - step.budget} "
                               f"tokens for {len(step.num_scheduled)} requests within {limits} "
                               f"(max_num_seqs={self.config.max_num_seqs})")
        finished = self.take_finished_req_ids()
        step_id = next(self._step_ids)
        self._in_flight = _InFlight(step_id, scheduled, step.swapped_out, step.tally)
        # A request preempted and re-admitted within one step is in both preempted_req_ids and
        # new_reqs: runners drop preempted state before taking in new requests.
        return SchedulerOutput(
            step_id=step_id, scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=step.num_scheduled,
            total_num_scheduled_tokens=limits.max_num_batched_tokens - step.budget,
            prefill_num_computed_tokens=step.prefill_computed, preempted_req_ids=step.preempted, finished_req_ids=finished,
            blocks_to_swap_out=step.blocks_to_swap_out, blocks_to_swap_in=step.blocks_to_swap_in)

    # ------------------------------------------------------------------ results of a step

    def _take_in_flight(self, scheduler_output: SchedulerOutput) -> _InFlight:
        in_flight = self._in_flight
        if in_flight is None or in_flight.step_id != scheduler_output.step_id:
            raise ValueError(f"step {scheduler_output.step_id} is not the step in flight "
                             f"({None if in_flight is None else in_flight.step_id}): already settled?")
        return in_flight

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           sampled_token_ids: dict[str, list[int]], now: float = 0.0) -> list[RequestUpdate]:
        """Advance each scheduled request by its computed tokens and append what was sampled.

        Tokens sampled for a request still mid-prefill are ignored. Requests that hit a stop
        condition are finished and their blocks freed. If this raises, the step stays in flight
        for `fail_step`, and no finished request is left among the running ones.
        """
        if not is_finite_number(now):  # token times and every measured period are read from it
            raise ValueError(f"now must be a finite number of seconds, got {now!r}")
        in_flight = self._take_in_flight(scheduler_output)
        updates: list[RequestUpdate] = []
        feedback = self._policy_wants_feedback
        served = StepServed()
        finished: list[Request] = []
        first_tokens: list[Request] = []  # whose first token this step sampled
        num_dropped = num_unsampled = 0
        # Bound once: the loop runs for every scheduled request of every step.
        requests, cache_blocks, check_stop = in_flight.requests, self.kv_cache_manager.cache_blocks, self._check_stop
        add_update, add_first = updates.append, first_tokens.append
        add_served = served.requests.append
        add_computed, add_recomputed = served.num_computed_tokens.append, served.num_recomputed_tokens.append
        add_output, add_decode = served.num_output_tokens.append, served.decode_requests.append
        try:
            for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
                request = requests[request_id]
                if request.status is not _RUNNING:
                    num_dropped += 1
                    continue  # aborted after it was scheduled (its id may already be reused)
                start = request.num_computed_tokens
                end = request.num_computed_tokens = start + num_tokens
                if end > request.max_computed_tokens:
                    num_recomputed = max(0, request.max_computed_tokens - start)
                    request.max_computed_tokens = end
                else:
                    num_recomputed = num_tokens
                cache_blocks(request)
                num_output = 0
                if end == len(request.all_token_ids):
                    sampled = sampled_token_ids.get(request_id)
                    if not sampled:
                        raise RuntimeError(f"request {request_id!r} finished its prefill but no token was sampled")
                    if not request.output_token_ids:
                        add_first(request)
                    for token_id in sampled:
                        num_output += 1
                        if request.append_output_token(token_id, now):
                            status = check_stop(request, token_id)
                            if status is not None:
                                self._finish(request, status, now)
                                finished.append(request)
                                break
                    add_update(RequestUpdate(request, sampled if num_output == len(sampled) else sampled[:num_output]))
                elif request.output_token_ids:
                    num_unsampled += 1  # computing its context again (recompute): its last token is old
                if feedback:
                    if num_tokens == 1 and num_output == 1 and num_recomputed == 0:
                        add_decode(request)
                    else:
                        add_served(request)
                        add_computed(num_tokens)
                        add_recomputed(num_recomputed)
                        add_output(num_output)
        finally:
            if finished:
                self.running = [r for r in self.running if r.status < _FINISHED]  # not r.is_finished
        self._in_flight = None
        if feedback:
            served.finished = finished
            self.policy.on_step_served(served, now)
        if self._controller_observes or self._policy_observes:
            composition = in_flight.tally.composition()
            num_copied = len(scheduler_output.blocks_to_swap_out) + len(scheduler_output.blocks_to_swap_in)
            if num_copied:  # the step's time includes its swap copies: so must what it is measured against
                composition += StepComposition(swap_bytes=num_copied * self.cache_config.kv_block_bytes)
            observation = observe_step(scheduler_output, composition, updates, finished,
                                       self.running, len(self.waiting), self.kv_cache_manager.get_usage(), now,
                                       first_tokens, num_dropped, num_unsampled)
            if self._controller_observes:
                self.batch_controller.on_step(observation)
            if self._policy_observes:
                self.policy.on_step_observed(observation)
        return updates

    def fail_step(self, scheduler_output: SchedulerOutput, now: float = 0.0) -> list[Request]:
        """The step did not run (or its results could not be applied): abort the requests it
        scheduled that are still unfinished, freeing their blocks, and return them. Requests
        the step did not schedule go on; those it swapped out, whose copies may never have been
        made, are recomputed instead."""
        in_flight = self._take_in_flight(scheduler_output)
        self._in_flight = None
        for request in in_flight.swapped_out:
            if request.status == RequestStatus.SWAPPED and self.requests.get(request.request_id) is request:
                self.swapped.remove(request)
                self._send_back_to_wait(request)
        failed = [r for r in in_flight.requests.values() if not r.is_finished]
        self.finish_requests([r.request_id for r in failed], RequestStatus.FINISHED_ABORTED, now)
        return failed

    @staticmethod
    def _check_stop(request: Request, token_id: int) -> Optional[RequestStatus]:
        """The status a sampled token leaves the request in; asked only when
        `append_output_token` said it may have finished it."""
        if len(request.all_token_ids) >= request.max_num_tokens:
            return RequestStatus.FINISHED_LENGTH
        params = request.sampling_params
        if len(request.output_token_ids) < params.min_tokens or token_id not in request.finishing_token_ids:
            return None
        if token_id != request.eos_token_id or params.ignore_eos:
            request.stop_reason = token_id
        return RequestStatus.FINISHED_STOPPED

"""The scheduler: one call decides one engine step.

There are no prefill and decode phases. Each step every chosen request gets a number of tokens
to compute (a prefill chunk or one decode token) within the token budget
(`max_num_batched_tokens`) and the sequence cap (`max_num_seqs`): running requests first, then
waiting ones in policy order. Time only enters as `now=` arguments, so the simulator and the
real engine make the same decisions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

from tokenweir.config import CacheConfig, SchedulerConfig
from tokenweir.core.block_pool import KVBlock
from tokenweir.core.kv_cache_manager import KVCacheManager, PrefixCacheStats
from tokenweir.core.queues import create_policy
from tokenweir.request import Request, RequestStatus, SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has no state for: first admission, or resumption after recompute
    preemption (then `token_ids` includes the outputs generated so far)."""

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hit: these tokens' K/V are already in the cache
    sampling_params: SamplingParams


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner already holds; only its newly allocated blocks are sent."""

    request_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # request id -> tokens to compute this step
    total_num_scheduled_tokens: int
    preempted_req_ids: set[str]  # the runner drops their state
    finished_req_ids: set[str]  # finished or aborted since the previous step
    # Swap preemption seam: (source block id, destination block id) pairs.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class RequestUpdate:
    """What one step changed for a request: the tokens it gained (status is on the request)."""

    request: Request
    new_token_ids: list[int]


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float  # 0..1
    num_preemptions: int  # cumulative
    prefix_cache: PrefixCacheStats  # cumulative


@dataclass
class _StepState:
    """Bookkeeping of the step being built, so a preemption can undo a victim's share."""

    budget: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_block_ids: dict[str, list[int]] = field(default_factory=dict)
    admitted: set[str] = field(default_factory=set)
    preempted: set[str] = field(default_factory=set)


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
        self.config = scheduler_config
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.kv_cache_manager = KVCacheManager(
            num_blocks=cache_config.num_blocks, block_size=cache_config.block_size,
            enable_caching=cache_config.enable_prefix_caching,
            watermark_blocks=cache_config.watermark_blocks)
        self.policy = create_policy(scheduler_config.policy)
        self.waiting = self.policy.make_waiting_queue()
        self.running: list[Request] = []  # admission order
        self.requests: dict[str, Request] = {}  # every unfinished request
        self._finished_req_ids: set[str] = set()
        self.num_preemptions = 0
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
        if request.num_prompt_tokens > self.max_model_len:
            request.status = RequestStatus.FINISHED_IGNORED
            request.finished_time = request.arrival_time
            request.status_message = (
                f"prompt has {request.num_prompt_tokens} tokens, more than the {self.max_model_len} "
                f"a request may hold ({self._describe_max_len()})")
            return
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def _describe_max_len(self) -> str:
        parts = [f"KV pool {self.cache_config.num_blocks} blocks x {self.block_size}"]
        if self.config.max_model_len is not None:
            parts.append(f"max_model_len {self.config.max_model_len}")
        if not self.config.enable_chunked_prefill:
            parts.append(f"max_num_batched_tokens {self.config.max_num_batched_tokens} without chunked prefill")
        return ", ".join(parts)

    def abort_requests(self, request_ids: Iterable[str], now: float = 0.0) -> None:
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED, now)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus, now: float = 0.0) -> None:
        """Finish requests from outside the step (abort; a stop string matched on detokenized
        text) in whatever state they are. Unknown or already finished ids are ignored: a client
        may abort a request that has just completed."""
        assert status.is_finished
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._finish(request, status, now)

    def _finish(self, request: Request, status: RequestStatus, now: float) -> None:
        """Terminal bookkeeping; the caller has already taken it out of running/waiting."""
        request.status = status
        request.finished_time = now
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._finished_req_ids.add(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def reset_prefix_cache(self) -> None:
        self.kv_cache_manager.reset_prefix_cache()

    def get_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(num_running=len(self.running), num_waiting=len(self.waiting),
                              num_swapped=0, kv_cache_usage=kv.get_usage(),
                              num_preemptions=self.num_preemptions,
                              prefix_cache=PrefixCacheStats(**vars(kv.prefix_cache_stats)))

    # ------------------------------------------------------------------ one step

    def schedule(self, now: float = 0.0) -> SchedulerOutput:
        step = _StepState(budget=self.config.max_num_batched_tokens)
        self.policy.begin_step(now, self.waiting, self.running)

        # 1. Running requests keep their place; each continues its prefill or decodes a token.
        for request in list(self.running):
            if step.budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this step to make room for another
            num_new = self._cap_tokens(request.num_tokens - request.num_computed_tokens, step.budget)
            blocks = self._allocate_or_preempt(request, num_new, step, admitting=False)
            if blocks is not None:
                self._schedule_tokens(request, num_new, blocks, step)

        # 2. Waiting requests, in policy order, while budget, sequence slots and blocks last.
        while self.waiting and step.budget > 0:
            # Off the queue while deciding: a victim preempted to make room for it goes back to
            # the queue's front, and must not be mistaken for it.
            request = self.waiting.pop()
            if not self._try_admit(request, step, now):
                self.waiting.push_front(request)
                break

        return self._make_output(step)

    def _try_admit(self, request: Request, step: _StepState, now: float) -> bool:
        """Admit a waiting request and schedule its first chunk; False if it cannot run now.

        A victim preempted for its sequence slot stays preempted even if the request then finds
        too few blocks; the checks that need no preemption come first to make that rare.
        """
        hits, num_hit = self.kv_cache_manager.get_computed_blocks(request)
        num_new = request.num_tokens - num_hit
        if not self.config.enable_chunked_prefill and num_new > step.budget:
            return False  # the whole prompt must go in one step: keep strict order, wait for room
        if len(self.running) >= self.config.max_num_seqs and not self._preempt_for(request, step):
            return False
        num_new = self._cap_tokens(num_new, step.budget)
        blocks = self._allocate_or_preempt(request, num_new, step, admitting=True,
                                           hits=hits, num_hit=num_hit)
        if blocks is None:
            return False
        self.kv_cache_manager.record_prefix_lookup(request, num_hit)
        self._admit(request, num_hit, now, step)
        self._schedule_tokens(request, num_new, blocks, step)
        return True

    def _cap_tokens(self, num_tokens: int, budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if threshold and num_tokens > threshold:
            num_tokens = threshold
        return min(num_tokens, budget)

    def _allocate_or_preempt(self, request: Request, num_new: int, step: _StepState, *,
                             admitting: bool, hits: Optional[list[KVBlock]] = None,
                             num_hit: int = 0) -> Optional[list[KVBlock]]:
        """Blocks for `num_new` tokens, preempting victims while the policy allows.

        A running request preempts until it fits or it is itself the victim. A waiting request
        only preempts victims the policy ranks below it. The watermark guards admissions only,
        and only while something runs: with an empty engine it would protect nobody and could
        keep a long request out forever.
        """
        while True:
            blocks = self.kv_cache_manager.allocate_slots(
                request, num_new, hits or (), num_hit, apply_watermark=admitting and bool(self.running))
            if blocks is not None:
                return blocks
            if not self.running:
                return None
            victim = self.policy.select_victim(self.running)
            if admitting and not self.policy.may_preempt(request, victim):
                return None
            self._preempt(victim, step)
            if victim is request:
                return None

    def _preempt_for(self, request: Request, step: _StepState) -> bool:
        """Free a sequence slot for a waiting request, if the policy ranks it above the victim."""
        victim = self.policy.select_victim(self.running)
        if not self.policy.may_preempt(request, victim):
            return False
        self._preempt(victim, step)
        return True

    def _preempt(self, victim: Request, step: _StepState) -> None:
        """Recompute preemption: free the victim's blocks and send it back to wait. If it was
        already given tokens this step, hand them back to the budget."""
        self.running.remove(victim)
        self.kv_cache_manager.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(victim)
        step.preempted.add(victim.request_id)
        # Its block ids and admission need no undoing: the output is built from `running`.
        step.budget += step.num_scheduled.pop(victim.request_id, 0)

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
    def _schedule_tokens(request: Request, num_new: int, blocks: list[KVBlock], step: _StepState) -> None:
        step.num_scheduled[request.request_id] = num_new
        step.budget -= num_new
        if blocks:
            step.new_block_ids[request.request_id] = [b.block_id for b in blocks]

    def _make_output(self, step: _StepState) -> SchedulerOutput:
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        for request in self.running:  # running order is the runner's batch order
            rid = request.request_id
            if rid not in step.num_scheduled:
                continue
            if rid in step.admitted:
                new_reqs.append(NewRequestData(
                    request_id=rid, token_ids=list(request.all_token_ids),
                    num_prompt_tokens=request.num_prompt_tokens,
                    block_ids=self.kv_cache_manager.get_block_ids(rid),
                    num_computed_tokens=request.num_computed_tokens,
                    sampling_params=request.sampling_params))
            else:
                cached_reqs.append(CachedRequestData(
                    rid, step.new_block_ids.get(rid, []), request.num_computed_tokens))
        assert step.budget >= 0, "the token budget was overspent"
        finished, self._finished_req_ids = self._finished_req_ids, set()
        # A request preempted and re-admitted within one step is in both preempted_req_ids and
        # new_reqs: runners drop preempted state before taking in new requests.
        return SchedulerOutput(
            scheduled_new_reqs=new_reqs, scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=step.num_scheduled,
            total_num_scheduled_tokens=self.config.max_num_batched_tokens - step.budget,
            preempted_req_ids=step.preempted, finished_req_ids=finished)

    # ------------------------------------------------------------------ results of a step

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           sampled_token_ids: dict[str, list[int]], now: float = 0.0) -> list[RequestUpdate]:
        """Advance each scheduled request by its computed tokens and append what was sampled.

        Tokens sampled for a request still mid-prefill are ignored. Requests that hit a stop
        condition are finished and their blocks freed.
        """
        updates: list[RequestUpdate] = []
        any_finished = False
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None:
                continue  # aborted after it was scheduled
            request.num_computed_tokens += num_tokens
            self.kv_cache_manager.cache_blocks(request)
            if request.num_computed_tokens < request.num_tokens:
                continue
            sampled = sampled_token_ids.get(request_id)
            if not sampled:
                raise RuntimeError(f"request {request_id!r} finished its prefill but no token was sampled")
            new_token_ids = []
            for token_id in sampled:
                request.append_output_token(token_id, now)
                new_token_ids.append(token_id)
                status = self._check_stop(request, token_id)
                if status is not None:
                    self._finish(request, status, now)
                    any_finished = True
                    break
            updates.append(RequestUpdate(request, new_token_ids))
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return updates

    def _check_stop(self, request: Request, token_id: int) -> Optional[RequestStatus]:
        params = request.sampling_params
        if (request.num_tokens >= self.max_model_len
                or (params.max_tokens is not None and request.num_output_tokens >= params.max_tokens)):
            return RequestStatus.FINISHED_LENGTH
        if request.num_output_tokens < params.min_tokens:
            return None
        if token_id == request.eos_token_id and not params.ignore_eos:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            request.stop_reason = token_id
            return RequestStatus.FINISHED_STOPPED
        return None

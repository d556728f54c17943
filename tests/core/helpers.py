"""Factories, a paged fake model and the leak check shared by the core tests (no torch)."""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Union

from tokenweir.config import CacheConfig, SchedulerConfig
from tokenweir.core.block_pool import BlockPool
from tokenweir.core.composition import CompositionConfig
from tokenweir.core.cost_model import StepCostModel
from tokenweir.core.kv_cache_manager import KVCacheManager
from tokenweir.core.policies import SchedulingPolicy
from tokenweir.core.scheduler import Scheduler, SchedulerOutput
from tokenweir.request import Request, SamplingParams, SchedulingHints

EOS = 2


def create_scheduler(*, max_num_batched_tokens: int = 64, max_num_seqs: Optional[int] = None,
                     max_model_len: Optional[int] = None, num_blocks: int = 64, block_size: int = 4,
                     policy: Union[str, SchedulingPolicy] = "fcfs", enable_chunked_prefill: bool = True,
                     long_prefill_token_threshold: int = 0, enable_prefix_caching: bool = True,
                     watermark: float = 0.0, preemption_mode: str = "recompute", num_host_blocks: int = 0,
                     kv_block_bytes: int = 0, cost_model: Optional[StepCostModel] = None,
                     composition: Optional[CompositionConfig] = None, int8_block_size: int = 0,
                     int8_kv_min_priority: Optional[int] = None) -> Scheduler:
    """A scheduler on tiny limits; `policy` is a registered name or a policy object to inject.
    `max_num_seqs` defaults to 16, or the budget if that is smaller (the budget must cover it).
    Swap preemption needs `num_host_blocks` (and, for `auto`, `kv_block_bytes`)."""
    if max_num_seqs is None:
        max_num_seqs = min(16, max_num_batched_tokens)
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                        max_model_len=max_model_len, policy=policy if isinstance(policy, str) else "fcfs",
                        enable_chunked_prefill=enable_chunked_prefill,
                        long_prefill_token_threshold=long_prefill_token_threshold,
                        composition=composition or CompositionConfig()),
        CacheConfig(block_size=block_size, num_blocks=num_blocks,
                    enable_prefix_caching=enable_prefix_caching, watermark=watermark,
                    preemption_mode=preemption_mode, num_host_blocks=num_host_blocks,
                    kv_block_bytes=kv_block_bytes, int8_block_size=int8_block_size,
                    int8_kv_min_priority=int8_kv_min_priority),
        policy=None if isinstance(policy, str) else policy, cost_model=cost_model)


def make_request(request_id: str, prompt: list[int] | int, *, max_tokens: Optional[int] = 4,
                 arrival_time: float = 0.0, priority: int = 0, tenant: Optional[str] = None,
                 cache_salt: Optional[str] = None, **params) -> Request:
    if isinstance(prompt, int):
        # Distinct tokens per request id, so prompts share nothing unless a test says so. A
        # stable hash: with the process's salted one, two ids collided once in ~1,000 runs (and
        # a prompt then hit the other's cached blocks).
        base = 1000 + 100 * (zlib.crc32(request_id.encode()) % 100_000)
        prompt = list(range(base, base + prompt))
    return Request(request_id=request_id, prompt_token_ids=prompt,
                   sampling_params=SamplingParams(max_tokens=max_tokens, **params),
                   arrival_time=arrival_time, eos_token_id=EOS,
                   hints=SchedulingHints(priority=priority, tenant=tenant, cache_salt=cache_salt))


def next_token(context: list[int]) -> int:
    """The fake model: a deterministic function of the whole context, never EOS."""
    h = 0
    for t in context:
        h = (h * 31 + t) % 1_000_003
    return 3 + h % 997


@dataclass
class _RunnerRequest:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    block_size: int  # tokens per block: the pool's, or an int8 request's


@dataclass
class PagedFakeRunner:
    """Stands in for the model runner and checks the scheduler's bookkeeping for real.

    It keeps its own copy of each request's tokens and block table, updated only from
    SchedulerOutput, "writes" each computed token into a fake paged KV cache at its slot, and
    computes the next token from the context it reads back through the block table. A wrong
    block table, a bad prefix-cache hit or a lost/duplicated token changes the output stream
    or trips an assertion. An int8 request's blocks hold `int8_block_size` tokens; a slot is
    (block, offset), so a block read with the wrong size, or by a request of the other kind
    (whose positions lie elsewhere in it), reads wrong positions.
    """

    block_size: int
    token_fn: Callable[[list[int]], int] = next_token
    int8_block_size: int = 0
    # slot (block, offset) -> (token, position)
    kv: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    host_kv: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)  # the host tier's slots
    state: dict[str, _RunnerRequest] = field(default_factory=dict)

    @classmethod
    def for_scheduler(cls, scheduler: Scheduler) -> PagedFakeRunner:
        return cls(scheduler.block_size, int8_block_size=scheduler.kv_cache_manager.int8_block_size)

    def _copy_blocks(self, src: dict[tuple[int, int], tuple[int, int]], dst: dict[tuple[int, int], tuple[int, int]],
                     pairs: list[tuple[int, int]]) -> None:
        for src_block, dst_block in pairs:
            for offset in range(max(self.block_size, self.int8_block_size)):
                entry = src.get((src_block, offset))
                if entry is None:
                    dst.pop((dst_block, offset), None)
                else:
                    dst[(dst_block, offset)] = entry

    def _slot(self, req: _RunnerRequest, pos: int) -> tuple[int, int]:
        return req.block_ids[pos // req.block_size], pos % req.block_size

    def _read(self, req: _RunnerRequest, upto: int) -> list[int]:
        context = []
        for pos in range(upto):
            token, stored_pos = self.kv[self._slot(req, pos)]
            assert stored_pos == pos, f"slot of position {pos} holds position {stored_pos}"
            context.append(token)
        return context

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        assert not (out.blocks_to_swap_out and out.blocks_to_swap_in), "a step swapped both ways"
        # Out before anything is written (the freed device blocks may be reused in this step),
        # in before anything is read.
        self._copy_blocks(self.kv, self.host_kv, out.blocks_to_swap_out)
        self._copy_blocks(self.host_kv, self.kv, [(h, d) for d, h in out.blocks_to_swap_in])
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.state.pop(rid, None)
        for new in out.scheduled_new_reqs:
            assert not new.kv_int8 or self.int8_block_size, "an int8 request, and the runner has no int8 blocks"
            self.state[new.request_id] = _RunnerRequest(
                list(new.token_ids), list(new.block_ids), new.num_computed_tokens,
                self.int8_block_size if new.kv_int8 else self.block_size)
        for rid, new_block_ids, num_computed in out.scheduled_cached_reqs.rows():
            req = self.state[rid]
            assert req.num_computed_tokens == num_computed
            req.block_ids.extend(new_block_ids)
        # Write all K/V of the step first, then attend, as the real model does per layer.
        for rid, n in out.num_scheduled_tokens.items():
            req = self.state[rid]
            assert n >= 1 and req.num_computed_tokens + n <= len(req.token_ids)
            for pos in range(req.num_computed_tokens, req.num_computed_tokens + n):
                self.kv[self._slot(req, pos)] = (req.token_ids[pos], pos)
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            req = self.state[rid]
            req.num_computed_tokens += n
            # "Attention" reads the whole context through the block table: prefix-cache hits
            # must hold exactly this request's tokens.
            context = self._read(req, req.num_computed_tokens)
            assert context == req.token_ids[:req.num_computed_tokens]
            if req.num_computed_tokens == len(req.token_ids):
                token = self.token_fn(context)
                req.token_ids.append(token)
                sampled[rid] = [token]
        return sampled


def reference_stream(prompt: list[int], num_tokens: int,
                     token_fn: Callable[[list[int]], int] = next_token) -> list[int]:
    """What a request generates when it runs alone and uninterrupted."""
    context, out = list(prompt), []
    for _ in range(num_tokens):
        token = token_fn(context)
        out.append(token)
        context.append(token)
    return out


def step(scheduler: Scheduler, runner: PagedFakeRunner, now: float = 0.0) -> SchedulerOutput:
    """One engine step with the invariants every step must keep."""
    out = scheduler.schedule(now=now)
    assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
    assert out.total_num_scheduled_tokens <= scheduler.config.max_num_batched_tokens
    assert len(out.num_scheduled_tokens) <= scheduler.config.max_num_seqs
    assert len(scheduler.running) <= scheduler.config.max_num_seqs
    assert_writes_own_blocks(scheduler, out)
    scheduler.update_from_output(out, runner.execute(out), now=now)
    return out


def assert_writes_own_blocks(scheduler: Scheduler, out: SchedulerOutput) -> None:
    """Every K/V position the step computes lands in a block its request holds alone and that
    is not published in the prefix cache: a shared or cached block is read, never written (the
    fake runner cannot see such a write when the tokens agree; a real model's K/V would change
    under the other readers)."""
    kv = scheduler.kv_cache_manager
    for request_id, num_tokens in out.num_scheduled_tokens.items():
        request = scheduler.requests[request_id]
        size = kv.tokens_per_block(request)
        blocks = kv.req_to_blocks[request_id]
        start = request.num_computed_tokens
        for index in range(start // size, (start + num_tokens - 1) // size + 1):
            block = blocks[index]
            assert block.ref_cnt == 1 and block.block_hash is None, (
                f"{request_id} writes positions {start}..{start + num_tokens - 1} into block {block.block_id} "
                f"(ref_cnt {block.ref_cnt}, published {block.block_hash is not None})")


def traced_run(scheduler: Scheduler, requests: list[Request], aborts: list[int] = (),
               extra: Callable[[Scheduler], object] = lambda s: None) -> tuple[list[tuple], list[tuple]]:
    """Steps at t = 0, 1, 2, ... until every request (added once t reaches its arrival_time,
    `requests` in arrival order) is done, aborting requests[t % n] at each t in `aborts`; every
    step checked (`step`), no leaks after. (Per step: t, its scheduled tokens, its preempted ids,
    the preemptions so far, `extra(scheduler)`; per request: id, status, output.)"""
    runner, pending, trace, t = PagedFakeRunner.for_scheduler(scheduler), list(requests), [], 0
    while pending or scheduler.has_unfinished_requests():
        while pending and pending[0].arrival_time <= t:
            scheduler.add_request(pending.pop(0))
        if t in aborts and requests:
            scheduler.abort_requests([requests[t % len(requests)].request_id], now=float(t))
        out = step(scheduler, runner, now=float(t))
        trace.append((t, dict(out.num_scheduled_tokens), sorted(out.preempted_req_ids), scheduler.num_preemptions,
                      extra(scheduler)))
        t += 1
        assert t < 5000, "no progress"
    assert_no_leaks(scheduler)
    return trace, [(r.request_id, r.status, r.output_token_ids) for r in requests]


def virtual_steps(scheduler: Scheduler, arrivals: list[tuple[float, Request]],
                  seconds: Callable[[SchedulerOutput], float]) -> Iterator[tuple[SchedulerOutput, float, int]]:
    """Engine steps in virtual time until every request is done: each request is added at its
    arrival time, each step is yielded (its output, the time it was scheduled at, the requests
    running before it was scheduled) before it is applied, and lasts `seconds(out)` (asked
    before the step's results advance the requests)."""
    pending, runner, now = sorted(arrivals, key=lambda x: x[0]), PagedFakeRunner.for_scheduler(scheduler), 0.0
    while pending or scheduler.has_unfinished_requests():
        while pending and pending[0][0] <= now:
            scheduler.add_request(pending.pop(0)[1])
        if not scheduler.has_unfinished_requests():
            now = pending[0][0]
            continue
        before = len(scheduler.running)
        out = scheduler.schedule(now)
        yield out, now, before
        now += seconds(out)
        scheduler.update_from_output(out, runner.execute(out), now)


def run_until_done(scheduler: Scheduler, runner: PagedFakeRunner, max_steps: int = 10_000) -> int:
    steps = 0
    while scheduler.has_unfinished_requests():
        step(scheduler, runner, now=float(steps))
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    return steps


def assert_pool_released(pool: BlockPool) -> None:
    """Every block has ref count 0 and sits exactly once in the free queue."""
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert pool.get_num_free_blocks() == pool.num_blocks
    assert sorted(b.block_id for b in pool.free_block_queue) == list(range(pool.num_blocks))


def assert_kv_released(kv: KVCacheManager) -> None:
    """No request holds blocks of either tier or a published-block count; every cached block
    is free and indexed under its own key."""
    assert kv.req_to_blocks == {} and kv.num_cached_blocks == {} and kv.req_to_host_blocks == {}
    assert_pool_released(kv.block_pool)
    if kv.host_pool is not None:
        assert_pool_released(kv.host_pool)
    for block_hash, block in kv.block_pool.cached_block_hash_to_block.items():
        assert block.block_hash == block_hash


def assert_no_leaks(scheduler: Scheduler) -> None:
    """After a test: nothing queued, running or in flight, every block free with ref count 0."""
    assert not scheduler.has_unfinished_requests(), list(scheduler.requests)
    assert len(scheduler.waiting) == 0 and len(scheduler.swapped) == 0 and scheduler.running == []
    assert scheduler.step_in_flight is None, "a scheduled step was neither applied nor failed"
    assert_kv_released(scheduler.kv_cache_manager)

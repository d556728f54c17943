"""Int8 K/V for low-priority requests, as the scheduler core sees it: which requests are
compressed, how many blocks they take, that their blocks are never shared with requests of the
model's dtype, and that streams stay exact under preemption (recompute and swap) and prefix hits.
The fake runner keeps each request's slots by its own block size, so a block table computed
with the wrong size reads wrong positions."""

from __future__ import annotations

import random

import pytest

from tests.core.helpers import (PagedFakeRunner, create_scheduler, make_request, reference_stream, run_until_done,
                                traced_run)
from tokenweir.config import CacheConfig, EngineArgs
from tokenweir.core.composition import CompositionConfig
from tokenweir.core.kv_cache_manager import KVCacheManager, int8_tokens_per_block
from tokenweir.request import RequestStatus


def test_an_int8_block_holds_what_fits_in_the_bytes_of_a_block_with_its_scales():
    # bf16, head_dim 64: 16 * 64 * 2 = 2048 bytes per block and head; 72 per int8 token with its
    # two scales (one per 32 channels).
    assert int8_tokens_per_block(16, 64, 2) == 28
    assert int8_tokens_per_block(16, 64, 4) == 56
    assert int8_tokens_per_block(16, 128, 2) == 28  # 4096 // (128 + 4 x 4) = 28
    assert int8_tokens_per_block(32, 64, 2) == 56
    assert int8_tokens_per_block(8, 16, 4) == 24  # 16 does not divide by 32: one scale, 512 // 20 = 25, even
    with pytest.raises(ValueError, match="fewer than 2 int8 tokens"):
        int8_tokens_per_block(2, 1, 1)


def test_requests_at_or_past_the_threshold_are_compressed_and_need_fewer_blocks(make_kv):
    kv = make_kv(num_blocks=40, block_size=4, int8_block_size=6, int8_min_priority=2)
    high = make_request("high", 24, priority=1)
    low = make_request("low", 24, priority=2)
    lower = make_request("lower", 24, priority=7)
    for request in (high, low, lower):
        kv.assign_kv_dtype(request)
    assert (high.kv_int8, low.kv_int8, lower.kv_int8) == (False, True, True)
    assert kv.allocate_slots(high, 24).num_blocks == 6  # 24 / 4
    assert kv.allocate_slots(low, 24).num_blocks == 4  # 24 / 6
    assert kv.allocate_slots(lower, 25).num_blocks == 5
    assert kv.get_num_free_blocks() == 40 - 15
    for request in (high, low, lower):
        kv.free(request)


def test_without_a_threshold_no_request_is_compressed(make_kv):
    kv = make_kv(num_blocks=8, block_size=4)
    request = make_request("r", 8, priority=100)
    kv.assign_kv_dtype(request)
    assert not request.kv_int8 and kv.tokens_per_block(request) == 4


# 4: blocks of one size in tokens too (not a size the engine makes): only the key's KV dtype
# then keeps the two kinds apart.
@pytest.mark.parametrize("int8_block_size", [8, 4])
def test_an_int8_block_is_never_shared_with_a_request_of_the_model_dtype(make_kv, int8_block_size):
    kv = make_kv(num_blocks=64, block_size=4, int8_block_size=int8_block_size, int8_min_priority=1)
    prompt = list(range(100, 133))
    first_int8, second_int8 = make_request("a", prompt, priority=1), make_request("b", prompt, priority=5)
    plain = make_request("c", prompt, priority=0)
    for request in (first_int8, second_int8, plain):
        kv.assign_kv_dtype(request)
    kv.allocate_slots(first_int8, len(prompt))
    first_int8.num_computed_tokens = len(prompt)
    kv.cache_blocks(first_int8)
    # Another int8 request finds the full int8 blocks (32 tokens) ...
    hits, num_tokens = kv.get_computed_blocks(second_int8)
    assert num_tokens == 32 and hits.get_block_ids() == kv.get_block_ids("a")[:32 // int8_block_size]
    # ... the same tokens in the model's dtype find nothing, and publish blocks of their own.
    assert kv.get_computed_blocks(plain) == (hits.__class__(), 0)
    kv.allocate_slots(plain, len(prompt))
    plain.num_computed_tokens = len(prompt)
    kv.cache_blocks(plain)
    assert not set(kv.get_block_ids("c")) & set(kv.get_block_ids("a"))
    assert kv.get_computed_blocks(make_request("d", prompt, priority=0))[1] == 32
    assert set(plain.block_hashes).isdisjoint(first_int8.block_hashes)
    for request in (first_int8, plain):
        kv.free(request)


def test_int8_needs_the_tokens_an_int8_block_holds():
    with pytest.raises(ValueError, match="int8_block_size >= 2"):
        KVCacheManager(num_blocks=8, block_size=4, int8_min_priority=1)
    with pytest.raises(ValueError, match="priority threshold must be an integer"):
        CacheConfig(int8_kv_min_priority=1.5)
    with pytest.raises(ValueError, match="tokens an int8 block holds"):
        EngineArgs(low_priority_kv_cache_dtype="int8").create_engine_configs(1024, 64)
    cache, _ = EngineArgs(low_priority_kv_cache_dtype="int8", low_priority_threshold=3).create_engine_configs(
        1024, 64, int8_block_size=28)
    assert (cache.int8_kv_min_priority, cache.int8_block_size) == (3, 28)
    assert EngineArgs().create_engine_configs(1024, 64)[0].int8_kv_min_priority is None
    with pytest.raises(ValueError, match="low_priority_threshold must be an integer priority"):
        EngineArgs(low_priority_kv_cache_dtype="int8", low_priority_threshold=1.5)
    with pytest.raises(ValueError, match="low_priority_threshold only applies"):
        EngineArgs(low_priority_threshold=2)


def _mixed_requests(rng: random.Random, n: int, prompt_tokens: int = 40, shared_prefix: int = 0) -> list:
    prefix = list(range(500, 500 + shared_prefix))
    requests = []
    for i in range(n):
        own = [rng.randrange(3, 1000) for _ in range(rng.randrange(1, prompt_tokens))]
        requests.append(make_request(f"r{i}", prefix + own, max_tokens=rng.randrange(1, 24),
                                     arrival_time=float(i // 3), priority=rng.choice((0, 1, 2))))
    return requests


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
@pytest.mark.parametrize("seed", range(4))
def test_mixed_streams_are_exact_under_preemption_and_prefix_hits(preemption_mode, seed):
    rng = random.Random(seed)
    requests = _mixed_requests(rng, 18, shared_prefix=12)
    scheduler = create_scheduler(num_blocks=24, block_size=4, int8_block_size=10, int8_kv_min_priority=1,
                                 max_num_batched_tokens=32, preemption_mode=preemption_mode,
                                 num_host_blocks=40 if preemption_mode == "swap" else 0,
                                 composition=CompositionConfig("cache-aware"))
    trace, results = traced_run(scheduler, requests)
    assert scheduler.num_preemptions > 0, "the pool is meant to be tight"
    assert any(r.kv_int8 for r in requests) and not all(r.kv_int8 for r in requests)
    for request, (_, status, output) in zip(requests, results):
        assert status is RequestStatus.FINISHED_LENGTH
        assert output == reference_stream(request.prompt_token_ids, request.sampling_params.max_tokens)
        assert request.kv_int8 == (request.priority >= 1)


def test_compressing_low_priority_requests_lets_more_run_at_once():
    """The same workload, the same pool: with int8 for the low-priority half, fewer preemptions
    and more requests running together."""
    def run(int8: bool) -> tuple[int, int]:
        scheduler = create_scheduler(num_blocks=40, block_size=4, max_num_batched_tokens=64, max_num_seqs=16,
                                     int8_block_size=8 if int8 else 0, int8_kv_min_priority=1 if int8 else None)
        for i in range(12):
            scheduler.add_request(make_request(f"r{i}", 20, max_tokens=12, priority=i % 2))
        runner, most_running = PagedFakeRunner.for_scheduler(scheduler), 0
        while scheduler.has_unfinished_requests():
            out = scheduler.schedule(now=0.0)
            most_running = max(most_running, len(out.num_scheduled_tokens))
            scheduler.update_from_output(out, runner.execute(out), now=0.0)
        return scheduler.num_preemptions, most_running

    (plain_preemptions, plain_running), (int8_preemptions, int8_running) = run(False), run(True)
    assert int8_running > plain_running
    assert int8_preemptions < plain_preemptions


def test_a_recompute_victim_is_priced_by_its_own_block_size():
    scheduler = create_scheduler(num_blocks=32, block_size=4, int8_block_size=8, int8_kv_min_priority=1,
                                 preemption_mode="auto", num_host_blocks=8, kv_block_bytes=1024)
    shared = list(range(200, 216))  # 2 int8 blocks
    first, second = make_request("a", shared + [1], priority=1), make_request("b", shared + [2], priority=1)
    runner = PagedFakeRunner.for_scheduler(scheduler)
    scheduler.add_request(first)
    out = scheduler.schedule(now=0.0)
    scheduler.update_from_output(out, runner.execute(out), now=0.0)
    scheduler.add_request(second)  # finds the first one's published blocks
    while not second.output_token_ids:
        out = scheduler.schedule(now=0.0)
        scheduler.update_from_output(out, runner.execute(out), now=0.0)
    kv = scheduler.kv_cache_manager
    assert kv.get_num_shared_blocks(first) == 2
    chooser = scheduler.preemption
    # Its 16 shared tokens are found again (2 blocks of 8), so only the rest is recomputed.
    expected = chooser.costs.prefill_seconds(first.num_computed_tokens - 16, num_context=16)
    assert chooser.recompute_seconds(first) == pytest.approx(expected)
    run_until_done(scheduler, runner)


def test_cache_aware_order_compares_cached_tokens_not_blocks():
    """An int8 request with 2 cached int8 blocks (16 tokens) has more of its prompt cached than
    one with 3 cached blocks of the model's dtype (12 tokens): cache-aware order admits it first."""
    scheduler = create_scheduler(num_blocks=64, block_size=4, int8_block_size=8, int8_kv_min_priority=1,
                                 max_num_seqs=1, composition=CompositionConfig("cache-aware"))
    int8_prefix, plain_prefix = list(range(300, 317)), list(range(400, 413))
    runner = PagedFakeRunner.for_scheduler(scheduler)
    for warm in (make_request("warm-int8", int8_prefix, max_tokens=1, priority=1),
                 make_request("warm-plain", plain_prefix, max_tokens=1, priority=0)):
        scheduler.add_request(warm)
        run_until_done(scheduler, runner)
    plain = make_request("plain", plain_prefix[:12] + [1, 2, 3, 4, 5], priority=0, arrival_time=1.0)
    int8 = make_request("int8", int8_prefix[:16] + [6, 7, 8, 9, 10], priority=1, arrival_time=2.0)
    scheduler.add_request(plain)  # first in arrival order
    scheduler.add_request(int8)
    out = scheduler.schedule(now=3.0)
    assert [new.request_id for new in out.scheduled_new_reqs] == ["int8"]
    assert (int8.num_cached_tokens, scheduler.kv_cache_manager.get_computed_blocks(plain)[1]) == (16, 12)
    scheduler.update_from_output(out, runner.execute(out), now=3.0)
    run_until_done(scheduler, runner)

"""Swap preemption through the real engine on a tiny model: the metrics and the log line are the
scheduler's real counts, an abort while swapped frees the host blocks, a step that swapped out
and then failed leaves its victims on the oracle's tokens (they are recomputed), and the swap
settings are checked when the engine is built."""

from __future__ import annotations

import logging

import pytest

from tests.engine.helpers import assert_engine_released, greedy_oracle
from tokenweir import SamplingParams
from tokenweir.config import EngineArgs
from tokenweir.core.cost_model import load_cost_model
from tokenweir.engine.core import EngineCore
from tokenweir.metrics import EngineMetrics, StatsLogger
from tokenweir.request import RequestStatus

NUM_NEW = 24
GREEDY = SamplingParams(max_tokens=NUM_NEW, min_tokens=NUM_NEW, temperature=0.0)
# Four prompts of 20-23 tokens growing by 24 on 16 blocks of 8 (128 tokens): the later ones are
# swapped out as the earlier ones grow.
PROMPTS = {f"r{i}": [3 + (7 * i + j) % 90 for j in range(20 + i)] for i in range(4)}


@pytest.fixture(scope="module")
def oracle(tiny_model_dir) -> dict[str, list[int]]:
    return greedy_oracle(tiny_model_dir("llama"), PROMPTS, NUM_NEW)


@pytest.fixture
def engine(make_llm, tiny_model_dir) -> EngineCore:
    return make_llm(tiny_model_dir("llama"), num_gpu_blocks_override=16, block_size=8,
                    preemption_mode="swap", swap_space=2**-10).engine


def add_all(engine: EngineCore) -> None:
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)


def finished_tokens(results) -> dict[str, list[int]]:
    return {o.request_id: o.outputs[0].token_ids for r in results for o in r.outputs if o.finished}


def test_metrics_and_log_line_count_what_swapping_did(engine, oracle, caplog):
    metrics = EngineMetrics("tiny", engine.scheduler_config.max_num_batched_tokens, engine.max_model_len)
    log = StatsLogger(interval_s=0.0, now=0.0)
    add_all(engine)
    results, swapped_seen = [], 0
    with caplog.at_level(logging.INFO, logger="tokenweir"):
        while engine.has_unfinished_requests():
            results.append(engine.step())
            stats = engine.get_stats()
            metrics.record_scheduler_stats(stats)
            log.maybe_log(stats, now=float(len(results)))
            swapped_seen = max(swapped_seen, stats.num_swapped)
            if stats.num_swapped:
                assert metrics.num_requests_swapped._value.get() == stats.num_swapped
    assert finished_tokens(results) == oracle
    stats = engine.get_stats()
    assert swapped_seen > 0 and stats.num_preemptions_by_mode["swap"] == stats.num_preemptions > 0
    assert stats.num_blocks_swapped_out >= stats.num_blocks_swapped_in > 0
    registry = metrics.registry
    for mode, n in stats.num_preemptions_by_mode.items():
        assert registry.get_sample_value("tokenweir:num_preemptions_total", {"model_name": "tiny", "mode": mode}) == n
    assert registry.get_sample_value("tokenweir:num_blocks_swapped_out_total", {"model_name": "tiny"}) \
        == stats.num_blocks_swapped_out
    assert registry.get_sample_value("tokenweir:num_blocks_swapped_in_total", {"model_name": "tiny"}) \
        == stats.num_blocks_swapped_in
    lines = [m for m in caplog.messages if "Blocks swapped out/in" in m]
    assert len(lines) == len(results)
    # The line's counts are per interval: they add up to the totals.
    swaps = sum(int(line.split(" swap, ")[0].rsplit("/ ", 1)[1]) for line in lines)
    out_in = [line.rsplit("Blocks swapped out/in: ", 1)[1].split("/") for line in lines]
    assert swaps == stats.num_preemptions_by_mode["swap"]
    assert sum(int(o) for o, _ in out_in) == stats.num_blocks_swapped_out
    assert sum(int(i) for _, i in out_in) == stats.num_blocks_swapped_in


def test_abort_while_swapped_frees_its_host_blocks(engine, oracle):
    add_all(engine)
    results = []
    while not engine.scheduler.swapped:
        results.append(engine.step())
    victim = next(iter(engine.scheduler.swapped))
    kv = engine.scheduler.kv_cache_manager
    num_held = len(kv.req_to_host_blocks[victim.request_id])
    free_before = kv.get_num_free_host_blocks()
    engine.abort_requests([victim.request_id])
    assert victim.status == RequestStatus.FINISHED_ABORTED
    assert victim.request_id not in kv.req_to_host_blocks
    assert kv.get_num_free_host_blocks() == free_before + num_held
    while engine.has_unfinished_requests():
        results.append(engine.step())
    done = finished_tokens(results)
    assert victim.request_id not in done
    assert done == {rid: t for rid, t in oracle.items() if rid != victim.request_id}
    # (make_llm's leak check: both tiers free, no runner state or generator left.)


def test_a_step_that_swapped_out_and_failed_recomputes_its_victims(engine, oracle):
    add_all(engine)
    results, victims = [], []
    while engine.has_unfinished_requests():
        scheduled = engine.schedule()
        if scheduled.blocks_to_swap_out and not victims:
            # The step never runs, so the victims' copies to the host never happen.
            victims = [rid for rid in scheduled.preempted_req_ids if rid not in scheduled.num_scheduled_tokens]
            result = engine.fail_step(scheduled, RuntimeError("lost"))
            assert set(result.failed) == set(scheduled.num_scheduled_tokens)
            assert all(engine.scheduler.requests[v].status == RequestStatus.PREEMPTED for v in victims)
        else:
            result = engine.execute(scheduled)
        results.append(result)
    assert victims
    done = finished_tokens(results)
    failed = {rid for r in results for rid in r.failed}
    assert set(done) == set(PROMPTS) - failed and not failed & set(victims)
    assert done == {rid: oracle[rid] for rid in done}


def test_auto_measures_the_copy_bandwidth_at_start(make_llm, tiny_model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="tokenweir"):
        engine = make_llm(tiny_model_dir("llama"), num_gpu_blocks_override=16, block_size=8,
                          preemption_mode="auto", swap_space=2**-10).engine
    costs = engine.scheduler.preemption.costs
    assert costs.swap_bytes_per_second > 0 and f"{costs.swap_bytes_per_second / 1e9:.2f} GB/s" in caplog.text
    # The rest of the shipped profile is kept: only the swap term is this device's.
    assert costs.coefficients == load_cost_model(None).coefficients


def test_swap_space_too_small_for_a_block_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match=r"swap_space of 1e-09 GiB holds no KV block of 6144 bytes"):
        EngineCore(EngineArgs(model=tiny_model_dir("llama"), dtype="float32", device="cpu",
                              num_gpu_blocks_override=16, block_size=8, preemption_mode="swap",
                              swap_space=1e-9))


def test_the_engine_sizes_the_host_tier_from_swap_space(engine):
    # 1 MiB of 6 kB blocks (a tiny Llama's 3 layers x K/V x 2 heads x 16 dims x 8 tokens x fp32).
    assert engine.cache_config.kv_block_bytes == 6144
    assert engine.cache_config.num_host_blocks == 2**20 // 6144
    assert engine.runner.host_kv_cache.num_blocks == engine.cache_config.num_host_blocks
    assert engine.scheduler.kv_cache_manager.host_pool.num_blocks == engine.cache_config.num_host_blocks
    assert_engine_released(engine)

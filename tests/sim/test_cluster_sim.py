"""The simulated cluster: replicas stepping concurrently behind the coordinator's own dispatch
and routers (cluster/dispatch.py). Hand-computed latencies, prefix affinity against round robin
on a shared-prefix workload, conservation and no leaks on every replica, determinism, and the
capacity of two replicas against one."""

from __future__ import annotations

import numpy as np
import pytest

from tests.core.helpers import assert_no_leaks
from tests.sim.helpers import cost_model
from tokenweir.cluster.config import ClusterConfig
from tokenweir.config import EngineArgs
from tokenweir.sim.cluster import ClusterSimulator
from tokenweir.sim.simulator import SimRequest, Simulator


def make_cluster(n: int, routing: str = "round_robin", model=None, depth: int = 2, **engine_kwargs) -> ClusterSimulator:
    return ClusterSimulator.from_engine_args(
        EngineArgs(**engine_kwargs), ClusterConfig(data_parallel_size=n, routing_policy=routing,
                                                   dispatch_queue_depth=depth), model or cost_model(step=0.1))


def req(rid: str, prompt_len: int, output_len: int, at: float, prefix: tuple[int, ...] = (), **kw) -> SimRequest:
    base = 1000 * (1 + sum(map(ord, rid)))  # distinct ids per request: no prefix hits but `prefix`
    return SimRequest(rid, [*prefix, *range(base, base + prompt_len)], output_len, at, **kw)


def test_hand_computed_latencies_on_two_replicas() -> None:
    # Every step takes 0.1 s. a and b (t=0) go to replicas 0 and 1 and run side by side: a's
    # steps end 0.1, 0.2, 0.3; b's 0.1, 0.2. c (t=0.15) is replica 0's turn: it joins a's batch
    # in the step 0.2-0.3 (TTFT 0.15) and ends at 0.4.
    cluster = make_cluster(2)
    result = cluster.run([req("a", 8, 3, 0.0), req("b", 4, 2, 0.0), req("c", 4, 2, 0.15)])
    a, b, c = result.records
    assert (a.ttft, a.latency) == pytest.approx((0.1, 0.3)) and (b.ttft, b.latency) == pytest.approx((0.1, 0.2))
    assert (c.ttft, c.latency) == pytest.approx((0.15, 0.25))
    assert result.num_steps == 6 and result.duration_s == pytest.approx(0.4)
    for sched in cluster.schedulers:
        assert_no_leaks(sched)


def shared_prefix_workload() -> list[SimRequest]:
    rng = np.random.default_rng(3)
    prefixes = [tuple(range(100_000 * (p + 1), 100_000 * (p + 1) + 256)) for p in range(6)]
    return [req(f"r{i}", 16, 8, i * 0.05, prefix=prefixes[int(rng.integers(0, 6))]) for i in range(120)]


def hit_rate(cluster: ClusterSimulator) -> float:
    stats = [s.kv_cache_manager.prefix_cache_stats for s in cluster.schedulers]
    return sum(s.hits for s in stats) / sum(s.queries for s in stats)


def test_prefix_affinity_finds_more_cached_prefixes_than_round_robin() -> None:
    # Pools of 60 blocks of 16 tokens: the 6 prefixes (16 blocks each) fit only split between
    # the two replicas.
    rates = {}
    for routing in ("round_robin", "prefix_affinity"):
        cluster = make_cluster(2, routing, cost_model(step=0.02, tokens=0.0005), num_gpu_blocks_override=60)
        result = cluster.run(shared_prefix_workload())
        assert all(r.success for r in result.records)
        rates[routing] = hit_rate(cluster)
    assert rates["prefix_affinity"] > rates["round_robin"] + 0.2, rates


def test_conservation_no_leaks_and_determinism_under_preemption_and_aborts() -> None:
    rng = np.random.default_rng(0)
    requests = [req(f"r{i}", int(rng.integers(10, 120)), int(rng.integers(1, 80)), float(i) * 0.01,
                    abort_after_s=0.05 if i % 7 == 0 else None) for i in range(80)]

    def run() -> tuple[ClusterSimulator, list]:
        cluster = make_cluster(3, "least_loaded", cost_model(step=0.01, tokens=0.0001), depth=4,
                               num_gpu_blocks_override=20, max_num_batched_tokens=64, max_num_seqs=16)
        return cluster, cluster.run(requests).records

    cluster, records = run()
    assert sum(s.num_preemptions for s in cluster.schedulers) > 0
    for sim, record in zip(requests, records):
        if sim.abort_after_s is None:
            assert record.success and record.output_tokens == sim.output_len
    assert any(not r.success for r in records)  # some clients gave up first
    for sched in cluster.schedulers:
        assert_no_leaks(sched)
    assert len(cluster.queue) == 0 and not cluster.where and not cluster.routes
    assert all(not r.cache.held and not r.inbox and not r.aborts for r in cluster.replicas)
    assert run()[1] == records


def test_two_replicas_take_about_half_the_time_of_one_on_a_saturating_burst() -> None:
    # Both replicas busy from start to end, each with half the work (their steps are not the
    # single engine's: half the rows per decode step, so somewhat more than half its time).
    requests = [req(f"r{i}", 64, 32, 0.0) for i in range(64)]
    model = cost_model(step=0.005, tokens=0.001)
    args = dict(max_num_batched_tokens=256, max_num_seqs=16)
    one = Simulator.from_engine_args(EngineArgs(**args), model).run(requests).duration_s
    cluster = make_cluster(2, "least_loaded", model, **args)
    two = cluster.run(requests).duration_s
    assert 0.45 * one < two < 0.6 * one
    assert [r.sim.num_steps for r in cluster.replicas] == [cluster.replicas[0].sim.num_steps] * 2


def test_a_slot_freed_as_a_step_starts_sends_the_held_request_at_once() -> None:
    # One client slot. a gives up at 0.05 during its first step; its replica hears of it when
    # that step ends (0.1), which frees the slot for b (held since 0.01): b is sent at 0.1 and
    # runs on a free replica at once, as on one engine.
    requests = [req("a", 8, 50, 0.0, abort_after_s=0.05), req("b", 8, 2, 0.01)]
    one = Simulator.from_engine_args(EngineArgs(), cost_model(step=0.1)).run(requests, max_concurrency=1)
    two = make_cluster(2).run(requests, max_concurrency=1)
    assert [r.success for r in two.records] == [False, True]
    assert two.records[1].latency == pytest.approx(one.records[1].latency) == pytest.approx(0.2)
    assert two.duration_s == pytest.approx(one.duration_s)

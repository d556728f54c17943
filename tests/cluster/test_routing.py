"""The routing policies on hand-made replica loads (pure Python, no Ray)."""

from __future__ import annotations

import pytest

from tokenweir.cluster.routing import ROUTERS, ReplicaLoad, RouteRequest, RouterConfig, create_router
from tokenweir.core.block_hash import BlockHash

A, B, C = (BlockHash(bytes([i]) * 32) for i in range(3))


def load(rid: int, running: int = 0, waiting: int = 0, kv: float = 0.0, step: float = 0.0,
         cached: frozenset = frozenset()) -> ReplicaLoad:
    return ReplicaLoad(rid, running, waiting, kv, 16, step, cached)


def request(*hashes: BlockHash) -> RouteRequest:
    return RouteRequest("r", list(hashes), 16 * len(hashes) + 3)


def test_round_robin_takes_turns_and_skips_replicas_not_offered():
    router = create_router("round_robin")
    three = [load(0), load(1), load(2)]
    assert [router.choose(request(), three) for _ in range(4)] == [0, 1, 2, 0]
    assert router.choose(request(), [load(0), load(2)]) == 2  # 1 is down: the next after 0
    assert router.choose(request(), [load(0), load(2)]) == 0


def test_least_loaded_counts_running_and_waiting_then_kv():
    router = create_router("least_loaded")
    assert router.choose(request(), [load(0, running=3), load(1, running=1, waiting=1), load(2, running=4)]) == 1
    assert router.choose(request(), [load(0, running=2, kv=0.5), load(1, running=2, kv=0.2)]) == 1


def test_prefix_affinity_follows_the_longest_cached_prefix_within_the_balance_bound():
    router = create_router("prefix_affinity", RouterConfig(balance_abs_threshold=2, balance_rel_threshold=1.5))
    replicas = [load(0, cached=frozenset({A})), load(1, running=1, cached=frozenset({A, B})), load(2)]
    assert router.choose(request(A, B, C), replicas) == 1  # 2 blocks beat 1
    # A hit stops at the first block missing: C first matches nothing anywhere, though 1 holds
    # B (keys are chained, so a real prompt's later block never matches without its parents).
    assert router.choose(request(C, B), replicas) == 0  # the least loaded (then the lowest id)
    # Beyond the bound (least loaded 0 + 2 requests, and 1.5x of 0), the cache gives way.
    busy = [load(0, cached=frozenset({A})), load(1, running=3, cached=frozenset({A, B}))]
    assert router.choose(request(A, B), busy) == 0


def test_prefix_affinity_relative_margin_admits_a_busier_cached_replica():
    router = create_router("prefix_affinity", RouterConfig(balance_abs_threshold=0, balance_rel_threshold=2.0))
    replicas = [load(0, running=10), load(1, running=19, cached=frozenset({A}))]
    assert router.choose(request(A), replicas) == 1  # 19 <= 2 x 10
    assert router.choose(request(A), [load(0, running=10), load(1, running=21, cached=frozenset({A}))]) == 0


def test_score_weighs_capacity_affinity_and_latency():
    router = create_router("score", RouterConfig(affinity_weight=1.0, latency_weight=10.0))
    # Same load: the cached one wins; then a slow step time costs more than the cache gives.
    assert router.choose(request(A, B), [load(0), load(1, cached=frozenset({A, B}))]) == 1
    assert router.choose(request(A, B), [load(0), load(1, step=0.2, cached=frozenset({A, B}))]) == 0
    # A full KV cache counts as load.
    assert router.choose(request(), [load(0, kv=0.9), load(1, running=4)]) == 1


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_every_router_picks_one_of_the_offered_replicas(name):
    router = create_router(name)
    for offered in ([load(3)], [load(1, running=5), load(4, cached=frozenset({A}))]):
        assert router.choose(request(A), offered) in {r.replica_id for r in offered}


def test_bad_names_and_knobs_are_refused():
    with pytest.raises(ValueError, match="unknown routing policy 'nearest'"):
        create_router("nearest")
    with pytest.raises(ValueError, match="balance_rel_threshold must be >= 1"):
        RouterConfig(balance_rel_threshold=0.5)
    with pytest.raises(ValueError, match="balance_abs_threshold must be >= 0"):
        RouterConfig(balance_abs_threshold=-1)

"""One round of dispatch from a global queue to replicas, and a prompt's routing keys.

Pure Python, shared by the cluster's coordinator (real replicas on Ray) and the simulator's
cluster (simulated replicas in virtual time), so a simulated routing decision is the real one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Container, Sequence

from tokenweir.cluster.config import ClusterConfig
from tokenweir.cluster.routing import ReplicaLoad, RouteRequest, Router
from tokenweir.config import CacheConfig
from tokenweir.core.block_hash import BlockHash, BlockHasher
from tokenweir.core.kv_cache_manager import extend_block_hashes
from tokenweir.core.policies import SchedulingPolicy
from tokenweir.core.queues import RequestQueue
from tokenweir.request import Request

# Queued requests that may be dispatched past one whose replica has no room, per round (as the
# scheduler looks past prompts held for a long-prefill slot: bounded, so a round stays cheap).
DISPATCH_LOOKAHEAD = 16
STEP_TIME_DECAY = 0.2  # weight of a replica's newest step in the step time the routers read


def mean_step_time(mean: float, elapsed: float) -> float:
    """A replica's step time as routers read it: a moving mean of its completed steps."""
    return mean + STEP_TIME_DECAY * (elapsed - mean) if mean else elapsed


def cluster_fields(cluster: ClusterConfig) -> dict[str, object]:
    """What a simulated result records of the cluster it ran on (nothing for one engine)."""
    if cluster.data_parallel_size == 1:
        return {}
    return {"data_parallel_size": cluster.data_parallel_size, "routing_policy": cluster.routing_policy,
            "routing_balance_abs_threshold": cluster.router.balance_abs_threshold,
            "routing_balance_rel_threshold": cluster.router.balance_rel_threshold,
            "dispatch_queue_depth": cluster.dispatch_queue_depth}


def route_request(request: Request, cache_config: CacheConfig, hasher: BlockHasher) -> RouteRequest:
    """The request as a router sees it: its prompt's prefix-cache keys, computed as a replica
    computes them (core/kv_cache_manager.extend_block_hashes; none without prefix caching)."""
    hashes: list[BlockHash] = []
    if cache_config.enable_prefix_caching:
        threshold = cache_config.int8_kv_min_priority
        kv_int8 = threshold is not None and request.priority >= threshold
        block_size = cache_config.int8_block_size if kv_int8 else cache_config.block_size
        extend_block_hashes(hasher, hashes, request.prompt_token_ids, block_size,
                            request.num_prompt_tokens // block_size, request.cache_salt, kv_int8)
    return RouteRequest(request.request_id, hashes, request.num_prompt_tokens)


class CacheView:
    """What a router reads as a replica's prefix cache: the keys it last reported (or, in the
    simulator, its live cache), and those of the prompts it holds now (waiting there or running:
    cached or about to be), which a report taken before their prefill lacks."""

    def __init__(self, reported: Container[BlockHash] = frozenset()) -> None:
        self.reported = reported
        self.held: Counter[BlockHash] = Counter()

    def __contains__(self, key: object) -> bool:
        return key in self.held or key in self.reported

    def hold(self, keys: Sequence[BlockHash], sign: int) -> None:
        for key in keys:
            self.held[key] += sign
            if not self.held[key]:
                del self.held[key]


def dispatch_round(queue: RequestQueue, policy: SchedulingPolicy, router: Router, now: float,
                   loads: Callable[[], list[ReplicaLoad]], has_room: Callable[[int], bool],
                   route: Callable[[Request], RouteRequest], send: Callable[[Request, int], None]) -> None:
    """Send queued requests, in the policy's order, each to the replica its router picks among
    the live ones (`loads()`, read again after every send), once that replica has room. One
    whose replica has none keeps its place, and up to DISPATCH_LOOKAHEAD behind it may go first
    to replicas with room (so an idle replica does not wait behind a busy one's queue)."""
    if not len(queue):
        return
    policy.begin_step(now, queue, [])
    passed: list[Request] = []
    while len(queue) and len(passed) < DISPATCH_LOOKAHEAD:
        live = loads()
        if not any(has_room(r.replica_id) for r in live):
            break
        request = queue.pop()
        chosen = router.choose(route(request), live)
        if has_room(chosen):
            send(request, chosen)
        else:
            passed.append(request)
    for request in reversed(passed):
        queue.push_front(request)
    policy.end_step(now)

"""Routing policies: which replica a request goes to.

Pure Python (no torch, no Ray): the coordinator routes with these classes, and anything that
models a cluster (a simulator, a test) can use the same ones. A router is a small class chosen
by name (`--routing-policy`); adding one is a class here and a line in ROUTERS.

A router sees every live replica's load and the request's prompt block hashes, the same keys
the replicas' prefix caches use (core/block_hash.py: stable across processes), so it can tell
how much of the prompt a replica has cached. The coordinator sends the request once the replica
chosen has room (at most `dispatch_queue_depth` requests there not started): a router that
prefers a cache waits for it, within the router's own balance bound.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import ClassVar

from tokenweir.core.block_hash import BlockHash


@dataclass(frozen=True)
class ReplicaLoad:
    """What the coordinator knows of a replica when it routes."""

    replica_id: int
    num_running: int
    num_waiting: int  # not started yet: waiting there, or sent and not yet acknowledged
    kv_cache_usage: float  # 0..1
    max_num_seqs: int
    step_time_s: float  # the replica's recent mean step time (0 before it has stepped)
    cached_blocks: Container[BlockHash]  # its prefix cache's keys (as last reported, and its prompts')

    @property
    def num_requests(self) -> int:
        return self.num_running + self.num_waiting

    def num_matched_blocks(self, block_hashes: Sequence[BlockHash]) -> int:
        """How many of the prompt's leading blocks this replica holds (a prefix hit stops at
        the first block it lacks)."""
        n = 0
        for block_hash in block_hashes:
            if block_hash not in self.cached_blocks:
                break
            n += 1
        return n


@dataclass(frozen=True)
class RouteRequest:
    request_id: str
    block_hashes: Sequence[BlockHash]  # of the prompt's full blocks, in order
    num_prompt_tokens: int


@dataclass(frozen=True)
class RouterConfig:
    # prefix_affinity: a replica is a candidate for its cache only while its load (requests
    # running and not started) is within a margin of the least loaded replica's: at most
    # `balance_abs_threshold` more requests, or at most `balance_rel_threshold` times as many
    # (either margin suffices).
    # Beyond them the cache gives way to balance (an always-hit replica would take everything).
    balance_abs_threshold: int = 4
    balance_rel_threshold: float = 1.5
    # score: the bonus for the share of the prompt cached, and the cost of a second of step time.
    affinity_weight: float = 1.0
    latency_weight: float = 1.0

    def __post_init__(self) -> None:
        if self.balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be >= 0, got {self.balance_abs_threshold}")
        if not self.balance_rel_threshold >= 1.0:
            raise ValueError(f"balance_rel_threshold must be >= 1, got {self.balance_rel_threshold}")
        for name in ("affinity_weight", "latency_weight"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


class Router(ABC):
    name: ClassVar[str]

    def __init__(self, config: RouterConfig = RouterConfig()) -> None:
        self.config = config

    @abstractmethod
    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> int:
        """The replica_id of one of `replicas` (never empty)."""


def _least_loaded(replicas: Sequence[ReplicaLoad]) -> ReplicaLoad:
    return min(replicas, key=lambda r: (r.num_requests, r.kv_cache_usage, r.replica_id))


class RoundRobinRouter(Router):
    """Each live replica in turn."""

    name = "round_robin"

    def __init__(self, config: RouterConfig = RouterConfig()) -> None:
        super().__init__(config)
        self._last = -1

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> int:
        ids = sorted(r.replica_id for r in replicas)
        self._last = next((i for i in ids if i > self._last), ids[0])
        return self._last


class LeastLoadedRouter(Router):
    """The replica with the fewest requests running and not started (then the emptiest KV cache)."""

    name = "least_loaded"

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> int:
        return _least_loaded(replicas).replica_id


class PrefixAffinityRouter(Router):
    """The replica that has cached the longest prefix of the prompt, among those whose load is
    within the balance margins of the least loaded one; the least loaded when none has any of it
    (SGLang's cache-aware router does the same with its own approximate tree)."""

    name = "prefix_affinity"

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> int:
        cfg = self.config
        least = _least_loaded(replicas)
        bound = max(least.num_requests + cfg.balance_abs_threshold, least.num_requests * cfg.balance_rel_threshold)
        balanced = [r for r in replicas if r.num_requests <= bound]
        best = max(balanced, key=lambda r: (r.num_matched_blocks(request.block_hashes), -r.num_requests,
                                            -r.replica_id))
        if best.num_matched_blocks(request.block_hashes) == 0:
            return least.replica_id
        return best.replica_id


class ScoreRouter(Router):
    """The seed's score: free capacity - load + affinity bonus - latency x weight, highest first.
    Capacity and load are fractions of the replica's sequence cap (the fuller of it and its KV
    cache), the bonus the share of the prompt's blocks cached there, latency its step time."""

    name = "score"

    def score(self, request: RouteRequest, replica: ReplicaLoad) -> float:
        cfg = self.config
        load = max(replica.num_requests / max(1, replica.max_num_seqs), replica.kv_cache_usage)
        affinity = (replica.num_matched_blocks(request.block_hashes) / len(request.block_hashes)
                    if request.block_hashes else 0.0)
        return 1.0 - load + cfg.affinity_weight * affinity - cfg.latency_weight * replica.step_time_s

    def choose(self, request: RouteRequest, replicas: Sequence[ReplicaLoad]) -> int:
        return max(replicas, key=lambda r: (self.score(request, r), -r.replica_id)).replica_id


ROUTERS: dict[str, type[Router]] = {r.name: r for r in (RoundRobinRouter, LeastLoadedRouter, PrefixAffinityRouter,
                                                         ScoreRouter)}


def create_router(name: str, config: RouterConfig = RouterConfig()) -> Router:
    if not isinstance(name, str) or name not in ROUTERS:
        raise ValueError(f"unknown routing policy {name!r}; choose one of {sorted(ROUTERS)}")
    return ROUTERS[name](config)

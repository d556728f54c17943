"""ClusterConfig: the flags of `tokenweir serve --data-parallel-size N` (vLLM's name for N)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Optional

from tokenweir.checks import is_finite_number, is_integer
from tokenweir.cluster.routing import ROUTERS, RouterConfig


MIN_HANG_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class ClusterConfig:
    data_parallel_size: int = 1  # replicas, each an engine in a Ray actor (1: no cluster)
    ray_address: Optional[str] = None  # None: start a local Ray on loopback; else join this cluster
    routing_policy: str = "prefix_affinity"
    router: RouterConfig = field(default_factory=RouterConfig)
    # Requests a replica may hold that it has not started (waiting there or on their way): the
    # rest wait in the coordinator's global queue, so a request is routed when a replica can
    # take it, with the freshest load and cache reports, and never sits behind a dead replica.
    dispatch_queue_depth: int = 2
    # A replica whose engine loop has been stuck this long (in a step or anywhere else), or
    # that has not answered a poll this long after it was due, is hung: it is killed and its
    # requests go on elsewhere.
    replica_hang_timeout: float = 30.0
    # Seconds to wait for a replica to load its model (first start and restarts).
    replica_startup_timeout: float = 600.0
    # Restarts of one replica slot in a row that may fail before the slot is given up.
    max_replica_restarts: int = 3
    # Times a request goes on after the replica it was on is lost; at the next loss it fails
    # (a request that kills every replica it reaches must not take the cluster down in turn).
    max_request_failovers: int = 2

    def __post_init__(self) -> None:
        for name in ("data_parallel_size", "dispatch_queue_depth"):
            if not is_integer(getattr(self, name)) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("max_replica_restarts", "max_request_failovers"):
            if not is_integer(getattr(self, name)) or getattr(self, name) < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {getattr(self, name)!r}")
        if self.routing_policy not in ROUTERS:
            raise ValueError(f"unknown routing policy {self.routing_policy!r}; choose one of {sorted(ROUTERS)}")
        if not is_finite_number(self.replica_startup_timeout) or self.replica_startup_timeout <= 0:
            raise ValueError(f"replica_startup_timeout must be a positive number of seconds, "
                             f"got {self.replica_startup_timeout!r}")
        # An idle replica's loop goes round once a second (replica.IDLE_WAIT_S): a shorter bound
        # would take an idle replica for a hung one.
        if not is_finite_number(self.replica_hang_timeout) or self.replica_hang_timeout < MIN_HANG_TIMEOUT_S:
            raise ValueError(f"replica_hang_timeout must be a number of seconds >= {MIN_HANG_TIMEOUT_S:g}, "
                             f"got {self.replica_hang_timeout!r}")


def add_cluster_args(parser: argparse.ArgumentParser, ray: bool = True) -> None:
    """The cluster's flags; without `ray` only those of its queue and routing (`simulate`'s)."""
    defaults, router = ClusterConfig(), RouterConfig()
    group = parser.add_argument_group("multi-replica serving (Ray)" if ray else "multi-replica (simulated)")
    group.add_argument("--data-parallel-size", "-dp", type=int, default=defaults.data_parallel_size,
                       help="serve from this many engine replicas" + (", each a Ray actor," if ray else "")
                            + " behind one global queue")
    if ray:
        group.add_argument("--ray-address", default=None,
                           help="join this Ray cluster (default: start one of its own on 127.0.0.1, stopped on exit, "
                                "even where another runs on this machine or RAY_ADDRESS is set)")
    group.add_argument("--routing-policy", default=defaults.routing_policy, choices=sorted(ROUTERS),
                       help="which replica a request goes to (default %(default)s)")
    group.add_argument("--routing-balance-abs-threshold", type=int, default=router.balance_abs_threshold,
                       help="prefix_affinity: follow the cache only to replicas with at most this many more "
                            "requests than the least loaded (default %(default)s) ...")
    group.add_argument("--routing-balance-rel-threshold", type=float, default=router.balance_rel_threshold,
                       help="... or at most this many times as many (default %(default)s)")
    group.add_argument("--dispatch-queue-depth", type=int, default=defaults.dispatch_queue_depth,
                       help="requests a replica may hold before starting them; the rest wait in the global "
                            "queue (default %(default)s)")
    if ray:
        group.add_argument("--replica-hang-timeout", type=float, default=defaults.replica_hang_timeout,
                           help="seconds after which a replica stuck in a step or silent is killed and its "
                                "requests continue on another (default %(default)s)")


def cluster_config_from(ns: argparse.Namespace) -> ClusterConfig:
    defaults = ClusterConfig()
    return ClusterConfig(
        data_parallel_size=ns.data_parallel_size, ray_address=getattr(ns, "ray_address", None),
        routing_policy=ns.routing_policy,
        router=RouterConfig(balance_abs_threshold=ns.routing_balance_abs_threshold,
                            balance_rel_threshold=ns.routing_balance_rel_threshold),
        dispatch_queue_depth=ns.dispatch_queue_depth,
        replica_hang_timeout=getattr(ns, "replica_hang_timeout", defaults.replica_hang_timeout))

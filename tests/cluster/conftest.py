"""A real two-replica cluster on a local Ray (loopback), each replica an actor process serving a
tiny random Llama; one per session (Ray and the replicas take seconds to start). Each test
leaves it idle: nothing queued, every replica holding no request, block or state."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from tests.server.conftest import wait_until
from tokenweir.cluster.config import ClusterConfig
from tokenweir.cluster.coordinator import ClusterEngine
from tokenweir.config import EngineArgs

HANG_TIMEOUT_S = 3.0


def cluster_args(model_dir: str) -> EngineArgs:
    return EngineArgs(model=model_dir, dtype="float32", device="cpu", num_gpu_blocks_override=96, block_size=16,
                      max_model_len=256, served_model_name="tiny-llama", disable_log_stats=True,
                      max_num_batched_tokens=64)


@pytest.fixture(scope="session")
def cluster_engine(tiny_model_dir: Callable[[str], str]) -> Iterator[ClusterEngine]:
    engine = ClusterEngine(cluster_args(tiny_model_dir("llama")),
                           ClusterConfig(data_parallel_size=2, replica_hang_timeout=HANG_TIMEOUT_S))
    yield engine
    engine.shutdown()


def wait_all_up(engine: ClusterEngine) -> None:
    wait_until(lambda: all(pid is not None for pid in engine.replica_pids()), "every replica to be up", 120.0)


@pytest.fixture
def cluster(cluster_engine: ClusterEngine) -> Iterator[ClusterEngine]:
    wait_all_up(cluster_engine)
    yield cluster_engine
    assert cluster_engine.is_running, cluster_engine.dead_error
    wait_until(lambda: cluster_engine.num_unfinished_requests() == 0, "the cluster to go idle", 60.0)
    wait_all_up(cluster_engine)
    # An abort ends a request at the coordinator at once; its replica lets go a moment later.
    wait_until(lambda: all(set(held.values()) == {0} for held in cluster_engine.replica_held()),
               "every replica to release every request, block and state", 30.0)
    # ... and its reports of it reach the coordinator a poll later.
    wait_until(lambda: cluster_engine.num_waiting_requests() == 0, "the cluster's waiting count to drain", 10.0)

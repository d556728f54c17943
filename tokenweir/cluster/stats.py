"""One SchedulerStats for the cluster, from its replicas' own, for the server's metrics and log.

Gauges are the cluster's now: requests running, waiting (the global queue's included), swapped
out, and the mean KV and swap space use. Counters (preemptions, prefix-cache queries and hits,
swapped blocks) are cumulative over the deployment: a replica that died and restarted starts
its own from zero, so what the dead one had counted is kept (`retire`) and the totals never
go back, as Prometheus counters must not.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence
from typing import Optional

from tokenweir.core.batch_control import StepLimits
from tokenweir.core.kv_cache_manager import PrefixCacheStats
from tokenweir.core.scheduler import SchedulerStats


def _sum_prefix(parts: Sequence[PrefixCacheStats]) -> PrefixCacheStats:
    return PrefixCacheStats(**{f.name: sum(getattr(p, f.name) for p in parts)
                               for f in dataclasses.fields(PrefixCacheStats)})


def retire(retired: Optional[SchedulerStats], last: SchedulerStats) -> SchedulerStats:
    """The counters of replicas gone, with those of one more (its last stats)."""
    parts = [last] if retired is None else [retired, last]
    return SchedulerStats(
        num_running=0, num_waiting=0, num_swapped=0, kv_cache_usage=0.0,
        num_preemptions=sum(p.num_preemptions for p in parts),
        prefix_cache=_sum_prefix([p.prefix_cache for p in parts]),
        num_preemptions_by_mode=dict(sum((Counter(p.num_preemptions_by_mode) for p in parts), Counter())),
        num_blocks_swapped_out=sum(p.num_blocks_swapped_out for p in parts),
        num_blocks_swapped_in=sum(p.num_blocks_swapped_in for p in parts))


def merge_stats(live: Sequence[SchedulerStats], retired: Optional[SchedulerStats], num_queued: int) -> SchedulerStats:
    """The cluster's stats: the live replicas' (their gauges), plus the retired counters and the
    requests in the global queue (waiting)."""
    counters = retired
    for stats in live:
        counters = retire(counters, stats)
    swap = [s.swap_space_usage for s in live if s.swap_space_usage is not None]
    limits = [s.batch_limits for s in live if s.batch_limits is not None]
    return SchedulerStats(
        num_running=sum(s.num_running for s in live),
        num_waiting=sum(s.num_waiting for s in live) + num_queued,
        num_swapped=sum(s.num_swapped for s in live),
        kv_cache_usage=sum(s.kv_cache_usage for s in live) / len(live) if live else 0.0,
        num_preemptions=counters.num_preemptions if counters else 0,
        prefix_cache=counters.prefix_cache if counters else PrefixCacheStats(),
        num_preemptions_by_mode=dict(counters.num_preemptions_by_mode) if counters else {},
        num_blocks_swapped_out=counters.num_blocks_swapped_out if counters else 0,
        num_blocks_swapped_in=counters.num_blocks_swapped_in if counters else 0,
        swap_space_usage=sum(swap) / len(swap) if swap else None,
        batch_controller=live[0].batch_controller if live else "static",
        # The cluster's step capacity: every live replica's limits together.
        batch_limits=StepLimits(sum(x.max_num_batched_tokens for x in limits), sum(x.max_num_seqs for x in limits))
        if limits else None,
        num_running_kv_int8=sum(s.num_running_kv_int8 for s in live))

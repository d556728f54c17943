"""The scheduler hands policies a step's feedback as columns (StepServed); the policies must
decide exactly as they did from one ServedRequest record per request: the same steps, token for
token, with the same preemptions and the same counters, over random workloads with chunked
prefills, recompute preemptions, priorities, SLOs, deadlines and tenants. Likewise `sla`'s
victim search with its lower-bound shortcuts decides as the search that scores every running
request."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from tests.core.helpers import EOS, PagedFakeRunner, assert_no_leaks, create_scheduler, step
from tokenweir.core.policies import SLAConfig, SLAPolicy, ServedRequest, StepServed, VTCPolicy
from tokenweir.request import Request, SamplingParams, SchedulingHints


class _FromRecords:
    """Mixin: feed the policy a list of ServedRequest records, as the scheduler used to."""

    def on_step_served(self, served: Sequence[ServedRequest], now: float) -> None:
        assert isinstance(served, StepServed)
        super().on_step_served(list(served), now)  # type: ignore[misc]


class _SLAFromRecords(_FromRecords, SLAPolicy):
    pass


class _VTCFromRecords(_FromRecords, VTCPolicy):
    pass


class _CountingSLA(SLAPolicy):
    """`sla` counting its exact victim searches."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.exact_searches = 0

    def _exact_victim(self, running: Sequence[Request], now: float) -> Request:
        self.exact_searches += 1
        return super()._exact_victim(running, now)


class _SLAExactVictims(_CountingSLA):
    """The straightforward `sla`: every victim by every running request's score."""

    def select_victim(self, running: Sequence[Request], now: float) -> Request:
        return self._exact_victim(running, now)


def _workload(seed: int) -> list[tuple[int, Request]]:
    rng = random.Random(seed)
    arrivals = []
    for i in range(60):
        interactive = rng.random() < 0.3
        hints = SchedulingHints(priority=0 if interactive else rng.randint(1, 3), tenant=rng.choice([None, "a", "b", "c"]),
                                ttft_slo=rng.choice([0.5, 2.0]) if interactive else 20.0,
                                tpot_slo=0.1 if interactive else 1.0,
                                deadline=rng.choice([None, None, 5.0, 30.0]))
        prefix = [100 + rng.randint(0, 2)] * 8 if rng.random() < 0.4 else []  # shared prefixes hit the cache
        prompt = prefix + [rng.randint(200, 900) for _ in range(rng.randint(1, 24))]
        at = rng.randint(0, 50)
        arrivals.append((at, Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 12)),
                                     arrival_time=at * 0.1, eos_token_id=EOS, hints=hints)))
    return sorted(arrivals, key=lambda a: a[0])


def _trace(policy, seed: int) -> tuple[list, dict]:
    s = create_scheduler(policy=policy, max_num_batched_tokens=24, max_num_seqs=6, num_blocks=28,
                         long_prefill_token_threshold=10)
    runner = PagedFakeRunner(s.block_size)
    pending = _workload(seed)
    trace, t = [], 0
    while pending or s.has_unfinished_requests():
        while pending and pending[0][0] <= t:
            s.add_request(pending.pop(0)[1])
        out = step(s, runner, now=t * 0.1)
        trace.append((list(out.num_scheduled_tokens.items()), sorted(out.preempted_req_ids)))
        t += 1
        assert t < 5000, "no progress"
    assert_no_leaks(s)
    counters = s.policy.counters
    return trace, (s.policy.get_stats(), None if counters is None else dict(counters.counters))


@pytest.mark.parametrize("make", [
    lambda records: (_SLAFromRecords if records else SLAPolicy)(),
    lambda records: (_SLAFromRecords if records else SLAPolicy)(SLAConfig(tenant_fairness=True)),
    lambda records: (_VTCFromRecords if records else VTCPolicy)(),
], ids=["sla", "sla-tenant-fairness", "vtc"])
@pytest.mark.parametrize("seed", range(4))
def test_columns_and_records_make_the_same_decisions(make, seed):
    columns, stats = _trace(make(False), seed)
    records, stats_from_records = _trace(make(True), seed)
    assert columns == records
    assert stats == stats_from_records
    assert stats[1] is None or any(stats[1].values()), "tenants should be charged"
    assert any(preempted for _, preempted in columns), "the workload should preempt"


@pytest.mark.parametrize("config", [SLAConfig(), SLAConfig(tenant_fairness=True),
                                    SLAConfig(base_weight=1.0, preempt_margin=0.5)],
                         ids=["defaults", "tenant-fairness", "urgency-across-levels"])
@pytest.mark.parametrize("seed", range(6))
def test_sla_victim_shortcuts_decide_as_the_exact_search(config, seed):
    fast, exact = _CountingSLA(config), _SLAExactVictims(config)
    fast_trace, (_, fast_counters) = _trace(fast, seed)
    exact_trace, (_, exact_counters) = _trace(exact, seed)
    assert fast_trace == exact_trace
    assert fast_counters == exact_counters
    assert any(preempted for _, preempted in fast_trace), "the workload should preempt"
    assert fast.exact_searches < exact.exact_searches, "the shortcuts should skip some searches"

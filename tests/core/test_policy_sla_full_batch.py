"""sla's head_may_preempt (a full batch skips its next request when no preemption can happen):
against a policy that always pops and tries the head, over random backlogs in many
configurations (swap mode, protection, SLO hints, shedding, aborts, partial prefills, classes,
tenant fairness): the same steps; every "no" checked against may_preempt for every running
request; tenant counter ties broken alike."""

from __future__ import annotations

from hypothesis import HealthCheck, example, given, note, settings
from hypothesis import strategies as st

from tests.core.helpers import EOS, PagedFakeRunner, assert_no_leaks, step, traced_run
from tokenweir.config import CacheConfig, SchedulerConfig
from tokenweir.core.composition import CompositionConfig
from tokenweir.core.policies import SLAConfig, SLAPolicy
from tokenweir.core.scheduler import Scheduler
from tokenweir.request import Request, SamplingParams, SchedulingHints


class _AlwaysTriesTheHead(SLAPolicy):
    """sla as before head_may_preempt: a full batch always pops its next request to try it."""

    def head_may_preempt(self, waiting, now: float) -> bool:
        return True


_arrival = st.tuples(st.integers(0, 10), st.integers(-1, 4), st.integers(1, 14), st.integers(1, 8),
                     st.sampled_from([None, 0.5, 3.0]), st.sampled_from([None, 0.3, 2.0]),
                     st.sampled_from([None, 2.0, 6.0]), st.sampled_from(["a", "b", "c"]))


def _req(i: int, at, priority, prompt_len, max_tokens, ttft, tpot, deadline, tenant) -> Request:
    base = 1000 + 50 * i
    return Request(f"r{i}", list(range(base, base + prompt_len)), SamplingParams(max_tokens=max_tokens),
                   arrival_time=at + i * 1e-6, eos_token_id=EOS,
                   hints=SchedulingHints(priority=priority, ttft_slo=ttft, tpot_slo=tpot, deadline=deadline,
                                         tenant=tenant))


# Found by hypothesis: a full batch's tried-and-put-back head made its tenant the "last chosen"
# that the lift of a tenant arriving to an empty backlog reads (fair_share.put_back undoes it).
@example(arrivals=[(0, 0, 1, 1, None, None, None, "a")] * 6 + [
             (0, 0, 1, 1, None, None, None, "b"), (0, 0, 1, 2, None, None, 2.0, "a"),
             (0, 0, 1, 2, None, None, None, "b"), (5, 0, 1, 1, None, None, None, "b"),
             (5, 0, 1, 1, None, None, None, "a")],
         max_wait=2.0, tenant_fairness=True, preempt_margin=0.0, num_blocks=10, swap=False, max_preemptions=1,
         drop_expired=False, protect_slos=False, classes=1, aborts=[], partial=False, max_num_seqs=2)
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrivals=st.lists(_arrival, min_size=6, max_size=30),
       max_wait=st.sampled_from([2.0, 5.0, 50.0]), tenant_fairness=st.booleans(),
       preempt_margin=st.sampled_from([0.0, 0.5, 1.5]), num_blocks=st.integers(10, 30),
       swap=st.booleans(), max_preemptions=st.sampled_from([1, 2, 5]), drop_expired=st.booleans(),
       protect_slos=st.booleans(), classes=st.sampled_from([1, 4]), aborts=st.lists(st.integers(0, 40), max_size=4),
       partial=st.booleans(), max_num_seqs=st.sampled_from([2, 3]))
def test_the_check_changes_nothing(arrivals, max_wait, tenant_fairness, preempt_margin, num_blocks, swap,
                                   max_preemptions, drop_expired, protect_slos, classes, aborts, partial,
                                   max_num_seqs):
    cfg = SLAConfig(max_wait=max_wait, tenant_fairness=tenant_fairness, preempt_margin=preempt_margin,
                    max_preemptions=max_preemptions, drop_expired=drop_expired, protect_slos=protect_slos,
                    num_priority_classes=classes, urgency_weight=4.0)
    runs = []
    for policy in (SLAPolicy(cfg), _AlwaysTriesTheHead(cfg)):
        s = Scheduler(
            SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=max_num_seqs,
                            long_prefill_token_threshold=4 if partial else 0,
                            max_num_partial_prefills=2 if partial else 1,
                            composition=CompositionConfig()),
            CacheConfig(block_size=4, num_blocks=num_blocks, enable_prefix_caching=True,
                        preemption_mode="swap" if swap else "recompute", num_host_blocks=40 if swap else 0),
            policy=policy)
        requests = [_req(i, *a) for i, a in enumerate(sorted(arrivals, key=lambda a: a[0]))]
        runs.append(traced_run(s, requests, aborts, lambda s: dict(s.num_preemptions_by_mode)))
    assert runs[0] == runs[1]


class _ChecksTheProof(SLAPolicy):
    """Whenever head_may_preempt says no, no running request is one the head may displace."""

    scheduler = None
    refusals = 0

    def head_may_preempt(self, waiting, now: float) -> bool:
        verdict = super().head_may_preempt(waiting, now)
        if not verdict:
            type(self).refusals += 1
            head = waiting.peek()
            self._running_scores.clear()  # scored afresh, as the pop's victim search would
            wrong = [r.request_id for r in self.scheduler.running if self.may_preempt(head, r, now)]
            assert not wrong, (now, head.request_id, wrong)
        return verdict


_tied = st.tuples(st.integers(0, 6), st.integers(0, 2), st.sampled_from([2, 8, 14]), st.integers(1, 8),
                  st.sampled_from([None, 0.5, 3.0]), st.sampled_from([None, 0.3, 2.0]),
                  st.sampled_from([None, 2.0, 6.0]), st.sampled_from(["a", "b", "c"]))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrivals=st.lists(_arrival | _tied, min_size=6, max_size=30),
       max_wait=st.sampled_from([0.3, 0.7, 1.1, 2.0, 5.0, 50.0]), tenant_fairness=st.booleans(),
       preempt_margin=st.sampled_from([0.0, 0.5, 1.5]), num_blocks=st.integers(10, 30),
       swap=st.booleans(), max_preemptions=st.sampled_from([1, 2, 5]), drop_expired=st.booleans(),
       protect_slos=st.booleans(), classes=st.sampled_from([1, 4]), aborts=st.lists(st.integers(0, 40), max_size=4),
       partial=st.booleans(), max_num_seqs=st.sampled_from([2, 3]), spread=st.booleans(),
       dt=st.sampled_from([1.0, 0.1, 0.3]))
def test_every_no_is_a_proof(arrivals, max_wait, tenant_fairness, preempt_margin, num_blocks, swap,
                             max_preemptions, drop_expired, protect_slos, classes, aborts, partial,
                             max_num_seqs, spread, dt):
    note(repr(dict(arrivals=arrivals, max_wait=max_wait, tenant_fairness=tenant_fairness, preempt_margin=preempt_margin,
                   num_blocks=num_blocks, swap=swap, max_preemptions=max_preemptions, drop_expired=drop_expired,
                   protect_slos=protect_slos, classes=classes, aborts=aborts, partial=partial,
                   max_num_seqs=max_num_seqs, spread=spread, dt=dt)))
    cfg = SLAConfig(max_wait=max_wait, tenant_fairness=tenant_fairness, preempt_margin=preempt_margin,
                    max_preemptions=max_preemptions, drop_expired=drop_expired, protect_slos=protect_slos,
                    num_priority_classes=classes, urgency_weight=4.0)
    policy = _ChecksTheProof(cfg)
    s = Scheduler(
        SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=max_num_seqs,
                        long_prefill_token_threshold=4 if partial else 0,
                        max_num_partial_prefills=2 if partial else 1),
        CacheConfig(block_size=4, num_blocks=num_blocks, enable_prefix_caching=True,
                    preemption_mode="swap" if swap else "recompute", num_host_blocks=40 if swap else 0),
        policy=policy)
    policy.scheduler = s
    runner = PagedFakeRunner(s.block_size)
    requests = []
    for i, a in enumerate(sorted(arrivals, key=lambda a: a[0])):
        r = _req(i, *a)
        if not spread:
            r.arrival_time = float(a[0]) * dt
        requests.append(r)
    pending = list(requests)
    t = 0
    while pending or s.has_unfinished_requests():
        now = t * dt
        while pending and pending[0].arrival_time <= now:
            s.add_request(pending.pop(0))
        if t in aborts and requests:
            s.abort_requests([requests[t % len(requests)].request_id], now=now)
        step(s, runner, now=now)
        t += 1
        assert t < 5000, "no progress"
    assert_no_leaks(s)


def test_tenant_counter_ties_are_broken_alike_with_and_without_the_check():
    """With tenant fairness and two tenants whose counters tie, popping and putting back the
    head re-makes its tenant's heaps at the end of the class's tenant dict: the tie must be
    broken by something that does not move (the tenant's name), or skipping the pop would
    admit another request than trying it does."""
    arrivals = [(0, 0, 1, 1, None, None, None, "a")] * 5 + [
        (0, 0, 1, 3, None, None, None, "a"), (1, 0, 1, 1, None, None, None, "a"),
        (2, 0, 1, 2, None, None, None, "c"), (2, 0, 1, 2, None, None, None, "c")]
    cfg = SLAConfig(max_wait=5.0, tenant_fairness=True, preempt_margin=0.0, max_preemptions=1,
                    protect_slos=False, num_priority_classes=1, urgency_weight=4.0)
    traces = []
    for policy in (SLAPolicy(cfg), _AlwaysTriesTheHead(cfg)):
        s = Scheduler(SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=2),
                      CacheConfig(block_size=4, num_blocks=10), policy=policy)
        runner = PagedFakeRunner(4)
        pending = [_req(i, *a) for i, a in enumerate(arrivals)]
        trace, t = [], 0
        while pending or s.has_unfinished_requests():
            while pending and pending[0].arrival_time <= t:
                s.add_request(pending.pop(0))
            trace.append(sorted(step(s, runner, now=float(t)).num_scheduled_tokens))
            t += 1
        traces.append(trace)
    assert traces[0] == traces[1]

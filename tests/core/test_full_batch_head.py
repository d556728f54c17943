"""fcfs never lets a waiting request displace a running one, and says so in head_may_preempt:
a full batch ends the step's admissions without popping and trying its next request. (vtc's
may_preempt is never true either, but popping its queue's head moves its tie-breaking state,
the last tenant chosen and the heap's entries, so it keeps trying: the steps could differ.)
Against fcfs always trying the head, over random backlogs (swap mode, partial prefills, admission orders, the `slo` controller
holding TPOT): the same steps, the same limits, the same streams; and the head is not popped
at a full batch (no torch)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.helpers import (EOS, PagedFakeRunner, assert_no_leaks, create_scheduler, make_request, step,
                                traced_run, virtual_steps)
from tests.core.test_batch_slo import MODEL
from tokenweir.config import CacheConfig, SchedulerConfig
from tokenweir.core.batch_slo import SLOBatchConfig
from tokenweir.core.composition import CompositionConfig
from tokenweir.core.policies import FCFSPolicy, PriorityPolicy, VTCPolicy
from tokenweir.core.scheduler import Scheduler
from tokenweir.request import Request, SamplingParams, SchedulingHints

class _FCFSTryingTheHead(FCFSPolicy):
    """fcfs as before: a full batch always pops its next request to try it."""

    def head_may_preempt(self, waiting, now: float) -> bool:
        return True


class _PreemptiveFCFS(FCFSPolicy):
    def may_preempt(self, waiting: Request, victim: Request, now: float) -> bool:
        return waiting.priority < victim.priority


@pytest.mark.parametrize("cls, says", [(FCFSPolicy, False), (_PreemptiveFCFS, True), (VTCPolicy, True),
                                       (PriorityPolicy, True)])
def test_fcfs_says_its_head_cannot_get_in_at_a_full_batch(cls, says):
    s = create_scheduler(max_num_batched_tokens=64, max_num_seqs=2, policy=cls())
    for i in range(3):
        s.add_request(make_request(f"r{i}", 4, max_tokens=20, priority=-i))
    runner = PagedFakeRunner(s.block_size)
    step(s, runner, now=0.0)
    assert len(s.running) == 2 and len(s.waiting) == 1
    popped = []
    pop = s.admission_order.pop
    s.admission_order.pop = lambda batch_full: popped.append(batch_full) or pop(batch_full)
    step(s, runner, now=1.0)
    assert s.policy.head_may_preempt(s.waiting, 1.0) is says
    assert popped == ([True] if says else [])  # tried (and put back) only where it might preempt


_arrival = st.tuples(st.integers(0, 10), st.integers(1, 14), st.integers(1, 8), st.sampled_from(["a", "b", "c"]),
                     st.integers(0, 2))


def _req(i: int, at, prompt_len, max_tokens, tenant, prefix) -> Request:
    base = 1000 + 50 * i
    shared = list(range(500 + 8 * prefix, 508 + 8 * prefix))  # a few shared prefixes for cache-aware
    return Request(f"r{i}", shared + list(range(base, base + prompt_len)),
                   SamplingParams(max_tokens=max_tokens, ignore_eos=bool(i % 2), temperature=0.0 if i % 3 else 0.8),
                   arrival_time=at + i * 1e-6, eos_token_id=EOS, hints=SchedulingHints(tenant=tenant))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrivals=st.lists(_arrival, min_size=4, max_size=24), num_blocks=st.integers(12, 30), swap=st.booleans(), partial=st.booleans(), max_num_seqs=st.sampled_from([2, 3]),
       order=st.sampled_from(["policy", "cache-aware", "length-aware", "sampling-grouped"]), slo=st.booleans(),
       aborts=st.lists(st.integers(0, 40), max_size=3))
def test_the_check_changes_nothing(arrivals, num_blocks, swap, partial, max_num_seqs, order, slo, aborts):
    runs = []
    for cls in (FCFSPolicy, _FCFSTryingTheHead):
        controller = dict(batch_controller="slo", batch_control_config=SLOBatchConfig(
            target_tpot_ms=3.0, hold="tpot", interval=2.0, window=6.0)) if slo else {}
        s = Scheduler(
            SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=max_num_seqs,
                            long_prefill_token_threshold=4 if partial else 0,
                            max_num_partial_prefills=2 if partial else 1,
                            composition=CompositionConfig(order), **controller),
            CacheConfig(block_size=4, num_blocks=num_blocks, enable_prefix_caching=True,
                        preemption_mode="swap" if swap else "recompute", num_host_blocks=40 if swap else 0),
            policy=cls(), cost_model=MODEL if slo else None)
        requests = [_req(i, *a) for i, a in enumerate(sorted(arrivals, key=lambda a: a[0]))]
        runs.append(traced_run(s, requests, aborts, lambda s: s.step_limits))
    assert runs[0] == runs[1]


def _held_back_at_adjustments(policy_cls, hold: str) -> tuple[list, list]:
    """A full cap of 2 with a prompt waiting, a running request finishing: the steps, and what
    each adjustment of `slo` read as held back."""
    config = SLOBatchConfig(target_tpot_ms=100.0, hold=hold, initial_num_batched_tokens=64, initial_num_seqs=2,
                            interval=0.001, window=1000.0)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=2, batch_controller="slo",
                                  batch_control_config=config),
                  CacheConfig(block_size=4, num_blocks=64, enable_prefix_caching=False),
                  policy=policy_cls(), cost_model=MODEL)
    c, seen = s.batch_controller, []
    adjust = c._adjust
    c._adjust = lambda now: (seen.append((round(now, 3), c._held_back)), adjust(now))
    arrivals = [(0.0, make_request("a", 8, max_tokens=3, ignore_eos=True, arrival_time=0.0)),
                (0.0, make_request("b", 8, max_tokens=10, ignore_eos=True, arrival_time=0.001)),
                (0.0, make_request("h", 100, max_tokens=2, ignore_eos=True, arrival_time=0.002))]
    steps = [(round(now, 3), dict(out.num_scheduled_tokens)) for out, now, _ in virtual_steps(s, arrivals, lambda out: 0.03)]
    assert_no_leaks(s)
    return steps, seen


@pytest.mark.parametrize("hold", ["itl", "tpot"])
def test_a_full_cap_still_counts_as_holding_back_for_the_controllers_feedback(hold):
    # Trying the head at a full cap asked the controller to cut its chunk, which marked the
    # step as held back; not trying it, the step's own rows at the cap must (a request that
    # finished in the step leaves the running count under it).
    assert (_held_back_at_adjustments(FCFSPolicy, hold)
            == _held_back_at_adjustments(_FCFSTryingTheHead, hold))

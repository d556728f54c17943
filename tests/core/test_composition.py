"""Admission orders (core/composition.py): what each one chooses, that they reorder only within
a policy's band, the aging bound of every order, and that streams and blocks are untouched."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenweir.config import EngineArgs
from tokenweir.core.composition import ADMISSION_ORDERS, CompositionConfig
from tokenweir.request import RequestStatus
from tests.core.helpers import PagedFakeRunner, assert_no_leaks, create_scheduler, make_request, step
from tests.core.test_scheduler_properties import check_workload, workloads

PREFIX = list(range(500, 516))  # 4 blocks of 4


def scheduler(order: str, *, max_wait: float = 5.0, window: int = 32, **kwargs):
    kwargs.setdefault("max_num_batched_tokens", 64)
    kwargs.setdefault("num_blocks", 64)
    return create_scheduler(composition=CompositionConfig(order, max_wait, window), **kwargs)


def warm(s, runner, prompt: list[int], now: float = 0.0) -> None:
    """Run one request with `prompt` to the end, so its full blocks stay in the prefix cache."""
    s.add_request(make_request("warm", prompt, max_tokens=1, arrival_time=now))
    while s.has_unfinished_requests():
        step(s, runner, now)


def first_admitted(s, runner, now: float) -> str:
    out = step(s, runner, now)
    return out.scheduled_new_reqs[0].request_id


@pytest.mark.parametrize("order, expected", [("policy", "miss"), ("cache-aware", "hit")])
def test_cache_aware_admits_the_longest_cached_prefix_first(order, expected):
    s = scheduler(order, max_num_seqs=1)
    runner = PagedFakeRunner(s.block_size)
    warm(s, runner, PREFIX + [1, 2])
    s.add_request(make_request("miss", 18, arrival_time=1.0))
    s.add_request(make_request("hit", PREFIX + [7, 8], arrival_time=2.0))
    assert first_admitted(s, runner, now=3.0) == expected


def test_a_request_that_waited_the_bound_goes_first():
    s = scheduler("cache-aware", max_wait=5.0, max_num_seqs=1)
    runner = PagedFakeRunner(s.block_size)
    warm(s, runner, PREFIX + [1, 2])
    s.add_request(make_request("miss", 18, arrival_time=1.0))
    s.add_request(make_request("hit", PREFIX + [7, 8], arrival_time=2.0))
    assert first_admitted(s, runner, now=1.0 + 5.0) == "miss"


def test_cache_aware_defers_a_request_that_would_compute_the_same_prefix_in_the_same_step():
    s = scheduler("cache-aware")
    runner = PagedFakeRunner(s.block_size)
    shared = list(range(700, 716))  # uncached
    s.add_request(make_request("a", shared + [1], arrival_time=0.0))
    s.add_request(make_request("b", shared + [2], arrival_time=1.0))
    s.add_request(make_request("c", 17, arrival_time=2.0))
    out = step(s, runner, now=2.0)
    assert [r.request_id for r in out.scheduled_new_reqs] == ["a", "c", "b"]


def test_priority_is_never_passed_for_a_cache_hit():
    s = scheduler("cache-aware", policy="priority", max_num_seqs=1)
    runner = PagedFakeRunner(s.block_size)
    warm(s, runner, PREFIX + [1, 2])
    s.add_request(make_request("hit-low", PREFIX + [7, 8], arrival_time=1.0, priority=1))
    s.add_request(make_request("miss-high", 18, arrival_time=2.0, priority=0))
    s.add_request(make_request("miss-low", 18, arrival_time=0.5, priority=1))
    assert first_admitted(s, runner, now=3.0) == "miss-high"
    step(s, runner, now=3.0)  # miss-high finishes (max_tokens=4: a few steps)
    while s.running:
        step(s, runner, now=3.0)
    # Within priority 1 the cached prefix goes first, ahead of an earlier miss.
    assert first_admitted(s, runner, now=3.0) == "hit-low"


def test_vtc_reorders_within_the_tenant_it_serves_next_only():
    s = scheduler("cache-aware", policy="vtc", max_num_seqs=1)
    runner = PagedFakeRunner(s.block_size)
    warm(s, runner, PREFIX + [1, 2])
    s.add_request(make_request("a-miss", 18, arrival_time=1.0, tenant="a"))
    s.add_request(make_request("a-hit", PREFIX + [7, 8], arrival_time=2.0, tenant="a"))
    s.add_request(make_request("b-hit", PREFIX + [5, 6], arrival_time=3.0, tenant="b"))
    tenant = s.policy.counters.min_backlogged()
    assert tenant == "a"
    assert first_admitted(s, runner, now=4.0) == "a-hit"


def test_sla_order_is_left_alone():
    s = scheduler("cache-aware", policy="sla", max_num_seqs=1)
    runner = PagedFakeRunner(s.block_size)
    warm(s, runner, PREFIX + [1, 2])
    s.add_request(make_request("miss", 18, arrival_time=1.0))
    s.add_request(make_request("hit", PREFIX + [7, 8], arrival_time=2.0))
    assert first_admitted(s, runner, now=3.0) == "miss"


def test_length_aware_follows_the_first_admission_of_the_step():
    s = scheduler("length-aware")
    runner = PagedFakeRunner(s.block_size)
    for rid, length, t in (("long", 30, 0.0), ("short", 3, 1.0), ("long2", 28, 2.0)):
        s.add_request(make_request(rid, length, arrival_time=t))
    out = step(s, runner, now=3.0)
    assert [r.request_id for r in out.scheduled_new_reqs] == ["long", "long2", "short"]


def test_sampling_grouped_keeps_an_all_greedy_batch_greedy():
    s = scheduler("sampling-grouped", max_num_seqs=2)
    runner = PagedFakeRunner(s.block_size)
    s.add_request(make_request("greedy", 5, max_tokens=20, arrival_time=0.0, temperature=0.0))
    step(s, runner, now=0.0)
    s.add_request(make_request("sampled", 5, arrival_time=1.0, temperature=1.0))
    s.add_request(make_request("greedy2", 5, arrival_time=2.0, temperature=0.0))
    assert first_admitted(s, runner, now=3.0) == "greedy2"


def test_orders_are_configured_by_engine_args_and_checked():
    args = EngineArgs(admission_order="cache-aware", admission_max_wait=2.5, admission_window=8)
    _, sched = args._scheduler_and_cache_configs(None, 0)
    assert sched.composition == CompositionConfig("cache-aware", 2.5, 8)
    with pytest.raises(ValueError, match="admission_order must be one of"):
        EngineArgs(admission_order="lpm")
    with pytest.raises(ValueError, match="admission_max_wait"):
        EngineArgs(admission_max_wait=-1.0)
    with pytest.raises(ValueError, match="admission_window"):
        EngineArgs(admission_window=0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(admission_max_wait=5.0), r"admission_max_wait applies only to an admission_order other than 'policy'"),
    (dict(admission_window=4, admission_max_wait=5.0), r"admission_max_wait, admission_window apply only"),
    (dict(scheduling_policy="sla", admission_order="cache-aware"),
     r"admission_order 'cache-aware' does nothing under scheduling_policy 'sla'"),
    (dict(admission_order="cache-aware", enable_prefix_caching=False), r"'cache-aware' needs enable_prefix_caching"),
])
def test_an_admission_order_that_would_do_nothing_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)._scheduler_and_cache_configs(None, 0)


# ---------------------------------------------------------------- properties

@st.composite
def ordered_workloads(draw):
    config, requests, resets = draw(workloads())
    config["policy"] = draw(st.sampled_from(["fcfs", "priority", "vtc", "sla"]))
    config["composition"] = CompositionConfig(draw(st.sampled_from(ADMISSION_ORDERS[1:])),
                                              draw(st.sampled_from([0.0, 3.0, 1e9])),
                                              draw(st.integers(1, 8)))
    return config, requests, resets


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ordered_workloads())
def test_admission_orders_keep_streams_exact_and_release_every_block(workload):
    """Only the order changes: every stream is the one its request produces alone (so the same
    as under the policy's own order), whatever the preemptions, aborts, chunking and cache hits,
    and afterwards every block is free and every queue empty (check_workload asserts both)."""
    check_workload(*workload)


BAND = {"fcfs": lambda r: None, "priority": lambda r: r.priority, "vtc": lambda r: r.tenant}
SHARED = [list(range(10, 22)), list(range(30, 38)), list(range(60, 76))]


@st.composite
def aging_workloads(draw):
    policy = draw(st.sampled_from(sorted(BAND)))
    config = dict(policy=policy, max_num_batched_tokens=draw(st.integers(8, 32)),
                  max_num_seqs=draw(st.integers(1, 4)), block_size=2, num_blocks=draw(st.integers(16, 40)),
                  composition=CompositionConfig(draw(st.sampled_from(ADMISSION_ORDERS[1:])),
                                                draw(st.sampled_from([0.0, 2.0, 5.0, 1e9])), window=64))
    requests = []
    for i in range(draw(st.integers(2, 14))):
        prefix = draw(st.sampled_from(SHARED + [[]]))
        suffix = draw(st.lists(st.integers(100, 120), min_size=1, max_size=10))
        requests.append(dict(rid=f"r{i}", prompt=prefix + suffix, arrival=draw(st.integers(0, 20)),
                             max_tokens=draw(st.integers(1, 8)), priority=draw(st.integers(0, 2)),
                             tenant=draw(st.sampled_from([None, "a", "b"])),
                             temperature=draw(st.sampled_from([0.0, 1.0]))))
    return config, requests


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(aging_workloads())
def test_no_request_is_passed_by_a_later_arrival_of_its_band_once_it_waited_the_bound(workload):
    """The guarantee, with the whole band in the window (admission_window >= the queue): in a
    step that admits request x, no request y of x's band (fcfs: all; priority: equal priority;
    vtc: same tenant) that arrived before x and has waited at least admission_max_wait is left
    waiting. So once a request has waited the bound, it waits no longer than its policy order
    gives it behind the requests that arrived before it. Also: under `priority` no waiting
    request of more importance (smaller priority) is ever left behind an admitted one."""
    config, specs = workload
    s = create_scheduler(**config)
    runner = PagedFakeRunner(s.block_size)
    band, max_wait = BAND[config["policy"]], config["composition"].max_wait
    pending = sorted(specs, key=lambda spec: spec["arrival"])
    t = 0
    while pending or s.has_unfinished_requests():
        while pending and pending[0]["arrival"] <= t:
            spec = pending.pop(0)
            s.add_request(make_request(spec["rid"], spec["prompt"], max_tokens=spec["max_tokens"],
                                       arrival_time=float(spec["arrival"]), priority=spec["priority"],
                                       tenant=spec["tenant"], temperature=spec["temperature"]))
        before = list(s.waiting)
        step(s, runner, now=float(t))
        left = [r for r in before if r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)]
        admitted = [r for r in before if r not in left]
        for x in admitted:
            for y in left:
                if band(y) == band(x) and y.arrival_time < x.arrival_time:
                    assert t - y.arrival_time < max_wait, (
                        f"step {t}: {x.request_id} (arrived {x.arrival_time}) admitted while "
                        f"{y.request_id} (arrived {y.arrival_time}) of its band waits past the bound")
                if config["policy"] == "priority":
                    assert y.priority >= x.priority, f"{x.request_id} admitted before more important {y.request_id}"
        t += 1
        assert t < 2000, "workload did not drain"
    assert_no_leaks(s)

"""Admission orders (core/composition.py): what each one chooses, alone and combined, that they
reorder only within a policy's band, the aging bound of every order, and that streams and blocks
are untouched."""

from __future__ import annotations

import argparse

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenweir.cli import add_engine_args, engine_args_from, engine_argv
from tokenweir.config import EngineArgs
from tokenweir.core.composition import ADMISSION_ORDERS, CompositionConfig
from tokenweir.request import RequestStatus
from tests.core.helpers import PagedFakeRunner, assert_no_leaks, create_scheduler, make_request, step
from tests.core.test_scheduler_properties import check_workload, workloads

PREFIX = list(range(500, 516))  # 4 blocks of 4
BAND_ORDERS = ADMISSION_ORDERS[1:]  # those that reorder a band, and compose


def combinations(min_size: int = 1):
    """Orders of BAND_ORDERS, one to all of them, in any order, as a tuple."""
    return st.permutations(BAND_ORDERS).flatmap(
        lambda names: st.integers(min_size, len(names)).map(lambda k: tuple(names[:k])))


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


@pytest.mark.parametrize("order", ["cache-aware", "length-aware", "cache-aware,length-aware"])
def test_an_order_keeps_nothing_of_the_requests_that_left_the_queue(order):
    # Its memo of cached prefixes held every request it ever matched until 65,536 of them, so
    # requests long finished stayed alive (their token lists too), freed in bulk.
    s = scheduler(order, max_num_batched_tokens=32, max_num_seqs=2, num_blocks=64)
    runner = PagedFakeRunner(s.block_size)
    for i in range(40):
        s.add_request(make_request(f"r{i}", PREFIX[:4 * (i % 4 + 1)] + [900 + i, 901 + i], max_tokens=2))
    now = 0.0
    while s.has_unfinished_requests():
        step(s, runner, now)
        assert len(s.admission_order.matcher._memo) <= len(s.waiting)
        now += 1.0
    assert not s.admission_order.matcher._memo
    assert_no_leaks(s)


@pytest.mark.parametrize("order", ["cache-aware", "length-aware"])
def test_an_aborted_waiting_request_is_not_kept_alive_by_the_memo(order):
    s = scheduler(order, max_num_batched_tokens=32, max_num_seqs=2, num_blocks=64)
    runner = PagedFakeRunner(s.block_size)
    for i in range(12):
        s.add_request(make_request(f"r{i}", PREFIX[:4 * (i % 4 + 1)] + [900 + i, 901 + i], max_tokens=4))
    step(s, runner, 0.0)
    step(s, runner, 1.0)  # the waiting ones matched (the band's window covers them)
    waiting = [r.request_id for r in s.waiting]
    assert waiting
    s.abort_requests(waiting, now=2.0)
    # A client that gave up on queued requests (timeouts under overload) left each in the memo,
    # token lists and all, until 65,536 accumulated and were freed in bulk.
    assert len(s.admission_order.matcher._memo) <= len(s.waiting)
    assert not [rid for rid, (r, *_) in s.admission_order.matcher._memo.items() if r.is_finished]


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


def test_an_order_that_could_do_nothing_is_refused_by_the_scheduler_too():
    # EngineArgs refuses these before a model is loaded; a scheduler built from its configs
    # directly (the simulator, a library user) must not take them as orders that work.
    from tokenweir.core.policies import SLAPolicy
    with pytest.raises(ValueError, match="does nothing under scheduling_policy 'sla'"):
        scheduler("cache-aware", policy="sla")
    with pytest.raises(ValueError, match="does nothing under scheduling_policy 'sla'"):
        scheduler("length-aware", policy=SLAPolicy())  # a policy object injected: its name decides
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        scheduler("length-aware,cache-aware", enable_prefix_caching=False)
    scheduler("length-aware", enable_prefix_caching=False)  # reads prompt lengths only


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


def test_cache_aware_then_sampling_grouped_breaks_cache_ties_by_the_batch_kind():
    """Neither order alone makes this choice: cache-aware alone takes the first of the two
    equal hits (sampled), sampling-grouped alone the first greedy one (a miss)."""
    def first(order: str) -> str:
        s = scheduler(order, max_num_seqs=2)
        runner = PagedFakeRunner(s.block_size)
        warm(s, runner, PREFIX + [1, 2])
        s.add_request(make_request("greedy", 5, max_tokens=20, arrival_time=0.0, temperature=0.0))
        step(s, runner, now=0.0)
        s.add_request(make_request("greedy-miss", 18, arrival_time=1.0, temperature=0.0))
        s.add_request(make_request("sampled-hit", PREFIX + [7, 8], arrival_time=2.0, temperature=1.0))
        s.add_request(make_request("greedy-hit", PREFIX + [5, 6], arrival_time=3.0, temperature=0.0))
        return first_admitted(s, runner, now=3.0)

    assert first("cache-aware") == "sampled-hit"
    assert first("sampling-grouped") == "greedy-miss"
    assert first("cache-aware,sampling-grouped") == "greedy-hit"
    assert first("sampling-grouped,cache-aware") == "greedy-hit"


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


DEFAULT_BOUNDS = {"admission_max_wait": CompositionConfig().max_wait, "admission_window": CompositionConfig().window}


@pytest.mark.parametrize("arg", sorted(DEFAULT_BOUNDS))
def test_a_bound_given_at_its_default_is_refused_with_the_policy_order(arg):
    """Given is given, whatever the value (the default's was accepted once, any other refused)."""
    with pytest.raises(ValueError, match=rf"^{arg} applies only to an admission_order other than 'policy'$"):
        EngineArgs(**{arg: DEFAULT_BOUNDS[arg]})
    with pytest.raises(ValueError, match=r"^admission_max_wait, admission_window apply only"):
        EngineArgs(admission_order="policy", **DEFAULT_BOUNDS)
    args = EngineArgs(admission_order="cache-aware", **{arg: DEFAULT_BOUNDS[arg]})
    _, sched = args._scheduler_and_cache_configs(None, 0)
    assert sched.composition == CompositionConfig("cache-aware")
    assert EngineArgs()._scheduler_and_cache_configs(None, 0)[1].composition == CompositionConfig()


@pytest.mark.parametrize("given", ["cache-aware,sampling-grouped", " cache-aware , sampling-grouped",
                                   ("cache-aware", "sampling-grouped"), ["cache-aware", "sampling-grouped"]])
def test_a_combination_is_given_as_names_joined_by_commas_or_a_tuple_or_list(given):
    args = EngineArgs(admission_order=given)
    assert args.admission_order == "cache-aware,sampling-grouped"  # one spelling, whatever was given
    _, sched = args._scheduler_and_cache_configs(None, 0)
    assert sched.composition == CompositionConfig(("cache-aware", "sampling-grouped"))
    assert sched.composition.orders == ("cache-aware", "sampling-grouped")
    assert CompositionConfig(given) != CompositionConfig("sampling-grouped,cache-aware")  # the first decides


def test_a_combination_goes_through_the_command_line_and_back():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)  # as serve, generate, profile and simulate take them
    args = engine_args_from(parser.parse_args(["--admission-order", "length-aware,cache-aware"]))
    assert args._scheduler_and_cache_configs(None, 0)[1].composition.orders == ("length-aware", "cache-aware")
    assert engine_argv(args) == ["--admission-order", "length-aware,cache-aware"]


@pytest.mark.parametrize("given, message", [
    ("cache-aware,lpm", r"admission_order must be one of .* got 'lpm' in 'cache-aware,lpm'"),
    ("", r"admission_order must be one of .* got '' in ''"),
    ("cache-aware,", r"got '' in 'cache-aware,'"),
    ((), r"admission_order must name at least one of"),
    (("cache-aware", 3), r"admission_order must be a name, comma-separated names or a tuple or list of names"),
    (None, r"admission_order must be a name"),
    ("cache-aware,length-aware,cache-aware", r"admission_order names 'cache-aware' twice"),
    ("policy,cache-aware", r"admission_order 'policy' \(the policy's own order, no reordering\) cannot be combined"),
    (["sampling-grouped", "policy"], r"'policy' .* cannot be combined with other orders"),
    ("policy,policy", r"admission_order names 'policy' twice"),
])
def test_a_bad_admission_order_is_refused_precisely(given, message):
    with pytest.raises(ValueError, match=message):
        CompositionConfig(given)
    with pytest.raises(ValueError, match=message):
        EngineArgs(admission_order=given)


@pytest.mark.parametrize("kwargs, message", [
    (dict(scheduling_policy="sla", admission_order="length-aware,sampling-grouped"),
     r"admission_order 'length-aware,sampling-grouped' does nothing under scheduling_policy 'sla'"),
    (dict(admission_order="sampling-grouped,cache-aware", enable_prefix_caching=False),
     r"'cache-aware' needs enable_prefix_caching"),
])
def test_each_order_of_a_combination_is_checked_as_alone(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)._scheduler_and_cache_configs(None, 0)
    # Without cache-aware, a combination runs without prefix caching.
    EngineArgs(admission_order="length-aware,sampling-grouped",
               enable_prefix_caching=False)._scheduler_and_cache_configs(None, 0)


# ---------------------------------------------------------------- choices against brute force

@st.composite
def band_states(draw):
    """A scheduler with a warm prefix cache, a running batch of either kind (or none) and a
    queue of requests sharing prefixes, arrived at different times, of several priorities,
    tenants and sampling kinds; an order (one or several) and a time to pop them at."""
    orders = draw(combinations())
    # Mostly no request aged, so that the keys choose; a small window sometimes.
    composition = CompositionConfig(orders, draw(st.sampled_from([3.0, 1e9, 1e9])), draw(st.sampled_from([3, 64, 64])))
    s = create_scheduler(policy=draw(st.sampled_from(sorted(BAND))), max_num_batched_tokens=64, max_num_seqs=8,
                         block_size=2, num_blocks=96,
                         # cache-aware needs a cache (refused without); the other orders take either
                         enable_prefix_caching="cache-aware" in composition.orders or draw(st.booleans()),
                         composition=composition)
    runner = PagedFakeRunner(s.block_size)
    for i, prefix in enumerate(draw(st.lists(st.sampled_from(SHARED), max_size=3))):
        warm_id = f"warm{i}"
        s.add_request(make_request(warm_id, prefix[:draw(st.integers(2, len(prefix)))] + [1], max_tokens=1))
        while s.has_unfinished_requests():
            step(s, runner, 0.0)
    for i, temperature in enumerate(draw(st.lists(st.sampled_from([0.0, 1.0]), max_size=3))):
        s.add_request(make_request(f"run{i}", 3, max_tokens=50, temperature=temperature))
    step(s, runner, 0.0)
    for i in range(draw(st.integers(2, 20))):
        prefix = draw(st.sampled_from(SHARED + [[]]))
        prefix = prefix[:draw(st.integers(0, len(prefix)))]
        suffix = draw(st.lists(st.integers(100, 120), min_size=1, max_size=10))
        s.add_request(make_request(f"r{i}", prefix + suffix, arrival_time=float(draw(st.integers(0, 10))),
                                   priority=draw(st.integers(0, 1)), tenant=draw(st.sampled_from(["a", "b"])),
                                   temperature=draw(st.sampled_from([0.0, 1.0]))))
    return s, 10.0


class BruteForce:
    """Each order's key from its definition, for every request of the band, and the band's
    minimum of their tuples (ties: queue order), after the aging rule."""

    def __init__(self, s, now: float) -> None:
        self.s, self.now, self.config = s, now, s.admission_order.config
        self.computing: set = set()
        self.reference = None
        self.greedy = all(r.sampling_params.greedy for r in s.running) if s.running else None

    def cached(self, r) -> tuple[int, int]:
        kv = self.s.kv_cache_manager
        most = (r.num_tokens - 1) // kv.block_size if kv.enable_caching else 0
        return kv.get_computed_blocks(r)[1] // kv.block_size, most

    def key(self, name: str, r) -> tuple:
        n, most = self.cached(r)
        if name == "cache-aware":
            return (1, 0) if n < most and r.block_hashes[n] in self.computing else (0, -n)
        if name == "length-aware":
            return (0 if self.reference is None else abs(r.num_tokens - n * self.s.block_size - self.reference),)
        return (0 if self.greedy is None else int(r.sampling_params.greedy != self.greedy),)

    def choice(self, band):
        aged = [r for r in band if self.now - r.arrival_time >= self.config.max_wait]
        if len(band) == 1 or aged:
            return band[0] if len(band) == 1 else min(aged, key=lambda r: r.arrival_time)
        keys = [tuple(self.key(name, r) for name in self.config.orders) for r in band]
        return band[keys.index(min(keys))]

    def chosen(self, r) -> None:
        n, most = self.cached(r)
        if n < most:
            self.computing.add(r.block_hashes[n])
        if self.reference is None:
            self.reference = r.num_tokens - n * self.s.block_size
        self.greedy = r.sampling_params.greedy if self.greedy is None else self.greedy and r.sampling_params.greedy


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(band_states())
def test_an_order_chooses_the_smallest_tuple_of_its_keys_within_the_band(state):
    """Pop after pop of one step (so the step's choices shape the keys), one order or several."""
    s, now = state
    order, brute = s.admission_order, BruteForce(s, now)
    order.begin_step(now, s.running)
    while s.waiting:
        band = list(s.waiting.band(order.config.window))
        expected = brute.choice(band) if band else None
        chosen = order.pop(batch_full=False)
        assert band == [] or chosen is expected, (
            f"{order.config.orders}: chose {chosen.request_id}, brute force {expected.request_id} "
            f"of {[r.request_id for r in band]}")
        brute.chosen(chosen)


# ---------------------------------------------------------------- properties

@st.composite
def ordered_workloads(draw):
    config, requests, resets = draw(workloads())
    # (sla is refused with any order but its own: its score leaves no band of equals.)
    config["policy"] = draw(st.sampled_from(["fcfs", "priority", "vtc"]))
    config["composition"] = CompositionConfig(draw(combinations()),
                                              draw(st.sampled_from([0.0, 3.0, 1e9])),
                                              draw(st.integers(1, 8)))
    if "cache-aware" in config["composition"].orders:
        config["enable_prefix_caching"] = True  # refused without a cache
    return config, requests, resets


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ordered_workloads())
def test_admission_orders_keep_streams_exact_and_release_every_block(workload):
    """Only the order changes, one order or several combined: every stream is the one its
    request produces alone (so the same as under the policy's own order), whatever the
    preemptions, aborts, chunking and cache hits, and afterwards every block is free and every
    queue empty (check_workload asserts both)."""
    check_workload(*workload)


BAND = {"fcfs": lambda r: None, "priority": lambda r: r.priority, "vtc": lambda r: r.tenant}
SHARED = [list(range(10, 22)), list(range(30, 38)), list(range(60, 76))]


@st.composite
def aging_workloads(draw):
    policy = draw(st.sampled_from(sorted(BAND)))
    config = dict(policy=policy, max_num_batched_tokens=draw(st.integers(8, 32)),
                  max_num_seqs=draw(st.integers(1, 4)), block_size=2, num_blocks=draw(st.integers(16, 40)),
                  composition=CompositionConfig(draw(combinations()),
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
    """The guarantee, for one order or several combined, with the whole band in the window
    (admission_window >= the queue): in a step that admits request x, no request y of x's band
    (fcfs: all; priority: equal priority; vtc: same tenant) that arrived before x and has waited
    at least admission_max_wait is left waiting. So once a request has waited the bound, it waits no longer than its policy order
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

"""Concurrent partial prefills (core/prefill_limits.py): the limits hold in every step, short
prompts pass long ones that wait for a long slot, long ones do not starve, policy order holds."""

from __future__ import annotations

import re
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenweir.config import CacheConfig, EngineArgs, SchedulerConfig
from tokenweir.core.policies import SLAConfig, create_policy, priority_key
from tokenweir.core.scheduler import Scheduler, SchedulerOutput
from tokenweir.request import Request, SchedulingHints
from tests.core.helpers import (PagedFakeRunner, assert_no_leaks, make_request, reference_stream,
                                run_until_done, step)


def limited(*, budget: int = 32, threshold: int = 8, partial: int = 3, long: int = 1, num_blocks: int = 400,
            max_num_seqs: int = 8, policy: str = "fcfs", block_size: int = 4, watermark: float = 0.0) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, policy=policy,
                        long_prefill_token_threshold=threshold, max_num_partial_prefills=partial,
                        max_long_partial_prefills=long),
        CacheConfig(block_size=block_size, num_blocks=num_blocks, watermark=watermark))


def first_steps(scheduler: Scheduler, arrivals: dict[int, list[Request]], max_steps: int = 500) -> dict[str, int]:
    """Run to the end (requests added at their step); the step each request was first scheduled."""
    runner, first, n = PagedFakeRunner(scheduler.block_size), {}, 0
    while n in arrivals or scheduler.has_unfinished_requests() or n <= max(arrivals):
        for request in arrivals.get(n, []):
            scheduler.add_request(request)
        out = step(scheduler, runner, now=float(n))
        for rid in out.num_scheduled_tokens:
            first.setdefault(rid, n)
        n += 1
        assert n < max_steps
    assert_no_leaks(scheduler)
    return first


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_num_partial_prefills=0), "max_num_partial_prefills must be an integer >= 1, got 0"),
    (dict(max_long_partial_prefills=True), "max_long_partial_prefills must be an integer >= 1, got True"),
    (dict(max_num_partial_prefills=2, max_long_partial_prefills=3),
     r"max_long_partial_prefills (3) must be <= max_num_partial_prefills (2)"),
    (dict(max_long_partial_prefills=2), r"max_long_partial_prefills (2) must be <= max_num_partial_prefills (1)"),
    (dict(max_num_partial_prefills=2, enable_chunked_prefill=False, max_model_len=2048),
     r"max_num_partial_prefills (2) > 1 limits prefills that are split across steps, but "
     "enable_chunked_prefill is off"),
    (dict(max_num_partial_prefills=300), r"max_num_partial_prefills (300) must be <= max_num_seqs (256)"),
    (dict(max_num_partial_prefills=2, long_prefill_token_threshold=600, max_model_len=500),
     r"long_prefill_token_threshold (600) cannot be greater than max_model_len (500)"),
])
def test_bad_config_is_a_precise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SchedulerConfig(**kwargs)


def test_threshold_defaults_to_four_percent_of_max_model_len_only_with_the_limits_on():
    assert SchedulerConfig(max_num_partial_prefills=2, max_model_len=8192).long_prefill_token_threshold == 327
    assert SchedulerConfig(max_num_partial_prefills=2, max_model_len=10).long_prefill_token_threshold == 1
    assert SchedulerConfig(max_num_partial_prefills=2, max_model_len=8192,
                           long_prefill_token_threshold=64).long_prefill_token_threshold == 64
    assert SchedulerConfig(max_model_len=8192).long_prefill_token_threshold == 0
    # The engine's args resolve it against the model's context.
    _, sched = EngineArgs(max_num_partial_prefills=4).create_engine_configs(model_max_len=2048, num_blocks=1000)
    assert (sched.max_num_partial_prefills, sched.max_long_partial_prefills) == (4, 1)
    assert sched.long_prefill_token_threshold == 81


def test_a_scheduler_without_a_threshold_or_max_model_len_refuses_the_limits():
    config = SchedulerConfig(max_num_partial_prefills=2)  # no max_model_len: nothing to derive from
    with pytest.raises(ValueError, match=re.escape("max_num_partial_prefills (2) > 1 needs a "
                                                   "long_prefill_token_threshold")):
        Scheduler(config, CacheConfig(block_size=4, num_blocks=16))


# ---------------------------------------------------------------- behaviour


def test_a_short_prompt_passes_a_long_one_waiting_for_a_long_slot():
    def arrivals() -> dict[int, list[Request]]:
        return {0: [make_request("L1", 100)], 1: [make_request("L2", 100), make_request("S", 5)]}

    first = first_steps(limited(), arrivals())
    assert first["S"] == 1  # admitted in the step it arrived, past L2
    assert first["L2"] > first["S"]
    # Plain chunked prefill: S waits behind L2 (FCFS, head of line) while L1 takes the budget.
    baseline = first_steps(limited(partial=1, long=1, threshold=0), arrivals())
    assert baseline["S"] > 1


def test_a_long_prompt_starts_as_soon_as_the_long_slot_frees_under_a_stream_of_short_ones():
    # A short prompt arrives every step, forever more than the step has room for beside L1.
    arrivals = {0: [make_request("L1", 60)]}
    arrivals[1] = [make_request("L2", 60)]
    for n in range(1, 40):
        arrivals.setdefault(n, []).append(make_request(f"S{n}", 6, max_tokens=2))
    scheduler = limited(budget=16, threshold=8, partial=2, long=1)
    runner, n, l1_short_at = PagedFakeRunner(4), 0, None
    while n < 40 or scheduler.has_unfinished_requests():
        for request in arrivals.get(n, []):
            scheduler.add_request(request)
        l1 = scheduler.requests.get("L1")
        if l1_short_at is None and l1 is not None and l1.num_tokens - l1.num_computed_tokens <= 8:
            l1_short_at = n  # L1 is no longer long from this step on: the slot is free
        out = step(scheduler, runner, now=float(n))
        if "L2" in out.num_scheduled_tokens:
            break
        n += 1
        assert n < 200, "L2 never started"
    assert l1_short_at is not None and n == l1_short_at
    while scheduler.has_unfinished_requests():
        n += 1
        for request in arrivals.get(n, []):
            scheduler.add_request(request)
        step(scheduler, runner, now=float(n))
    assert_no_leaks(scheduler)


def test_a_short_prompt_never_passes_a_long_one_of_higher_priority():
    arrivals = {0: [make_request("L1", 100, priority=0)],
                1: [make_request("L2", 100, priority=0), make_request("S_low", 5, priority=1),
                    make_request("S_same", 5, priority=0)]}
    first = first_steps(limited(policy="priority"), arrivals)
    assert first["S_same"] == 1  # the same level: only arrival ranks it behind L2
    assert first["S_low"] >= first["L2"]


def test_no_more_prefills_than_the_limit_are_left_unfinished():
    # Two long prefills hold both slots; S fits no slot: with 4 tokens of budget left it would
    # be a third partial prefill. The leftover tops L1 up instead.
    scheduler, runner = limited(budget=20, threshold=8, partial=2, long=2), PagedFakeRunner(4)
    for rid, length in (("L1", 100), ("L2", 100), ("S", 6)):
        scheduler.add_request(make_request(rid, length))
    assert step(scheduler, runner).num_scheduled_tokens == {"L1": 12, "L2": 8}
    run_until_done(scheduler, runner)
    assert_no_leaks(scheduler)


def test_the_leftover_budget_tops_up_the_long_prefill_and_short_ones_go_first():
    scheduler, runner = limited(budget=32, threshold=8), PagedFakeRunner(4)
    scheduler.add_request(make_request("L", 100))
    out = step(scheduler, runner)
    assert out.num_scheduled_tokens == {"L": 32}  # alone: the whole budget, as without the limits
    scheduler.add_request(make_request("S1", 5))
    scheduler.add_request(make_request("S2", 7))
    out = step(scheduler, runner, now=1.0)
    assert out.num_scheduled_tokens == {"L": 20, "S1": 5, "S2": 7}
    run_until_done(scheduler, runner)
    assert_no_leaks(scheduler)


def test_the_top_up_never_preempts_nor_takes_the_admission_reserve():
    # 16 blocks of 4, a reserve of 3. R holds 7 once it decodes; L's first chunk (8 tokens) takes
    # 2, leaving 7 free: topping L up to the step's 31 tokens would take 6 more, which fit only
    # by using the reserve.
    scheduler, runner = limited(budget=32, threshold=8, num_blocks=16, watermark=0.2), PagedFakeRunner(4)
    scheduler.add_request(make_request("R", 24, max_tokens=30))
    step(scheduler, runner)
    scheduler.add_request(make_request("L", 40))
    out = step(scheduler, runner, now=1.0)
    assert scheduler.num_preemptions == 0
    free_after = scheduler.kv_cache_manager.get_num_free_blocks()
    assert free_after >= scheduler.kv_cache_manager.watermark_blocks
    assert out.num_scheduled_tokens["L"] == 8
    run_until_done(scheduler, runner)
    assert_no_leaks(scheduler)


# ---------------------------------------------------------------- properties


def prefill_counts(scheduler: Scheduler, out: SchedulerOutput, num_tokens: dict[str, int]) -> tuple[int, int]:
    """The step's partial prefills (left unfinished) and its long prefills, as the runner sees
    them: tokens left after what is computed (prefix hits of a new request included)."""
    threshold = scheduler.config.long_prefill_token_threshold
    computed = {new.request_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
    computed.update(zip(out.scheduled_cached_reqs.req_ids, out.scheduled_cached_reqs.num_computed_tokens))
    left = {rid: num_tokens[rid] - computed[rid] for rid in out.num_scheduled_tokens}
    return (sum(1 for rid, n in out.num_scheduled_tokens.items() if 1 < left[rid] and n < left[rid]),
            sum(1 for rid in left if left[rid] > threshold))


@st.composite
def workloads(draw):
    partial = draw(st.integers(2, 4))
    budget = draw(st.integers(8, 40))
    config = dict(budget=budget, threshold=draw(st.integers(1, 12)), partial=partial,
                  long=draw(st.integers(1, partial)), num_blocks=draw(st.integers(12, 80)),
                  max_num_seqs=draw(st.integers(partial, min(8, budget))),
                  policy=draw(st.sampled_from(["fcfs", "priority"])), block_size=draw(st.sampled_from([1, 4])),
                  watermark=draw(st.sampled_from([0.0, 0.1])))
    requests = [dict(rid=f"r{i}", length=draw(st.one_of(st.integers(1, 6), st.integers(10, 40))),
                     max_tokens=draw(st.integers(1, 6)), arrival=draw(st.integers(0, 10)),
                     priority=draw(st.integers(0, 2)))
                for i in range(draw(st.integers(1, 12)))]
    return config, requests


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_limits_and_policy_order_hold_in_every_step(workload):
    config, specs = workload
    scheduler = limited(**config)
    queue_position: dict[str, int] = {}

    def rank(r: Request) -> tuple:
        """The policy's order: FCFS the queue's (victims go back to its front), priority its key."""
        if config["policy"] == "fcfs":
            return (queue_position[r.request_id],)
        return priority_key(r)

    runner = PagedFakeRunner(scheduler.block_size)
    threshold = scheduler.config.long_prefill_token_threshold
    requests = {s["rid"]: make_request(s["rid"], s["length"], max_tokens=s["max_tokens"], arrival_time=s["arrival"],
                                       priority=s["priority"]) for s in specs}
    n = 0
    while n <= 10 or scheduler.has_unfinished_requests():
        for s in specs:
            if s["arrival"] == n:
                scheduler.add_request(requests[s["rid"]])
        queue_position = {r.request_id: i for i, r in enumerate(scheduler.waiting)}
        waiting_before = sorted(scheduler.waiting, key=rank)
        left_before = {rid: r.num_tokens - r.num_computed_tokens for rid, r in scheduler.requests.items()}
        tokens_before = {rid: r.num_tokens for rid, r in scheduler.requests.items()}
        out = step(scheduler, runner, now=float(n))
        num_partial, num_long = prefill_counts(scheduler, out, tokens_before)
        assert num_partial <= scheduler.config.max_num_partial_prefills
        assert num_long <= scheduler.config.max_long_partial_prefills
        in_prefill = [r for r in scheduler.running if r.num_tokens - r.num_computed_tokens > 1]
        assert len(in_prefill) <= scheduler.config.max_num_partial_prefills
        admitted = [r for r in waiting_before if r.request_id in out.num_scheduled_tokens]
        still_waiting = [r for r in waiting_before if r.request_id not in out.num_scheduled_tokens
                         and r in scheduler.waiting]
        for a in admitted:
            for w in still_waiting:
                if rank(w) < rank(a):  # passed: only a long prompt, never a higher priority
                    assert left_before[w.request_id] > threshold
                    assert w.priority == a.priority or config["policy"] == "fcfs"
        n += 1
        assert n < 2000, "no progress"
    for r in requests.values():  # each stream as if alone, cut short only by the pool's size
        got = list(r.output_token_ids)
        assert got == reference_stream(r.prompt_token_ids, r.sampling_params.max_tokens)[:len(got)]
        assert len(got) == r.sampling_params.max_tokens or r.num_tokens >= scheduler.max_model_len
    assert_no_leaks(scheduler)


def test_by_default_the_threshold_stays_a_hard_cap_and_nothing_is_passed():
    """max_num_partial_prefills 1 (the default) switches the limits and the top-up off."""
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8, long_prefill_token_threshold=8),
                          CacheConfig(block_size=4, num_blocks=200))
    assert scheduler.prefill_limits is None
    runner, steps, n = PagedFakeRunner(4), [], 0
    for i, length in enumerate([100, 100, 5]):
        scheduler.add_request(make_request(f"r{i}", length))
    while scheduler.has_unfinished_requests():
        steps.append(dict(step(scheduler, runner, now=float(n)).num_scheduled_tokens))
        n += 1
    assert_no_leaks(scheduler)
    assert steps[0] == {"r0": 8, "r1": 8, "r2": 5}
    assert max(max(s.values()) for s in steps) == 8


def with_deadline(request_id: str, deadline: float, arrival_time: float = 0.0) -> Request:
    return Request(request_id, [5, 6, 7], make_request(request_id, 3).sampling_params, arrival_time=arrival_time,
                   eos_token_id=2, hints=SchedulingHints(deadline=deadline))


def test_which_policies_let_a_short_prompt_overtake():
    fcfs, vtc, sla = create_policy("fcfs"), create_policy("vtc"), create_policy("sla")
    sla_tenants = create_policy("sla", SLAConfig(tenant_fairness=True))
    short, long = make_request("s", 3, arrival_time=1.0, tenant="a"), make_request("l", 90, tenant="a")
    other_tenant = make_request("o", 3, arrival_time=1.0, tenant="b")
    assert fcfs.may_overtake(short, long, now=1.0)
    assert vtc.may_overtake(short, long, now=1.0) and not vtc.may_overtake(other_tenant, long, now=1.0)
    assert sla.may_overtake(short, long, now=1.0) and sla.may_overtake(other_tenant, long, now=1.0)
    assert not sla_tenants.may_overtake(other_tenant, long, now=1.0)
    # sla: never past a higher class, an earlier deadline, or a request past the wait bound.
    assert not sla.may_overtake(make_request("p", 3, priority=1, arrival_time=1.0), long, now=1.0)
    assert not sla.may_overtake(with_deadline("late", 30.0, 1.0), with_deadline("soon", 10.0), now=1.0)
    assert sla.may_overtake(with_deadline("soon", 5.0, 1.0), with_deadline("late", 30.0), now=1.0)
    assert not sla.may_overtake(short, long, now=SLAConfig().max_wait + 1)
    assert not create_policy("priority").may_overtake(make_request("p", 3, priority=1), long, now=1.0)

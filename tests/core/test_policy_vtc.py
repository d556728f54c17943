"""The `vtc` policy and its counters: charging (no charge for recomputation or cache hits), the
lift rule on a scripted scenario, the fair-share bound against FCFS, weights, no leaks."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.helpers import EOS, PagedFakeRunner, assert_no_leaks, create_scheduler, reference_stream, step
from tokenweir.core.policies import ServedRequest, VTCConfig, VTCPolicy, parse_tenant_weights
from tokenweir.core.policies.fair_share import VirtualTokenCounters, fresh_prompt_tokens
from tokenweir.request import Request, SamplingParams, SchedulingHints


def _req(rid: str, tenant, prompt_len: int = 8, max_tokens: int = 4, arrival: float = 0.0) -> Request:
    base = 1000 + 50 * (abs(hash(rid)) % 1000)
    return Request(rid, list(range(base, base + prompt_len)), SamplingParams(max_tokens=max_tokens),
                   arrival_time=arrival, eos_token_id=EOS, hints=SchedulingHints(tenant=tenant))


def _served(request: Request, start: int, computed: int, recomputed: int = 0, outputs: int = 0) -> ServedRequest:
    request.num_computed_tokens = start + computed  # as update_from_output leaves it
    return ServedRequest(request, computed, recomputed, outputs)


def test_counters_charge_fresh_prompt_tokens_and_outputs_by_weight():
    counters = VirtualTokenCounters(VTCConfig(input_weight=1.0, output_weight=2.0, tenant_weights={"gold": 2.0}))
    a, g = _req("a", "a", prompt_len=8), _req("g", "gold", prompt_len=8)
    counters.charge([_served(a, 0, 5), _served(g, 0, 8, outputs=1)])  # a: a chunk of 5; g: all + 1 token
    assert counters.counter("a") == 5.0
    assert counters.counter("gold") == (8 + 2) / 2.0
    counters.charge([_served(a, 5, 3, outputs=1), _served(_req("a2", "a", prompt_len=2), 0, 2)])
    assert counters.counter("a") == 5 + 3 + 2 + 2
    # After a preemption: 6 tokens computed again (recomputed) then 2 fresh ones of the prompt.
    b = _req("b", "b", prompt_len=12)
    s = _served(b, 0, 8, recomputed=6)
    assert fresh_prompt_tokens(s) == 2
    counters.charge([s])
    assert counters.counter("b") == 2.0
    # Decode of an output token's K/V (its position is past the prompt) charges nothing as input.
    assert fresh_prompt_tokens(_served(b, 12, 1, outputs=1)) == 0
    # A prefix-cache hit of 4: the step computes tokens 4..8 only.
    assert fresh_prompt_tokens(_served(_req("c", "c", prompt_len=8), 4, 4)) == 4


def test_the_smallest_counter_goes_first_and_a_newly_backlogged_tenant_is_lifted():
    counters = VirtualTokenCounters(VTCConfig())
    counters.add_waiting("a")
    counters.add_waiting("b")
    a, b = _req("a", "a"), _req("b", "b")
    counters.charge([_served(a, 0, 8, outputs=1)])  # a: 10
    counters.charge([_served(b, 0, 4)])  # b: 4
    assert counters.min_backlogged() == "b"
    counters.charge([_served(b, 4, 4, outputs=2)])  # b: 4 + 4 + 4 = 12
    assert counters.min_backlogged() == "a"
    # c arrives: lifted from 0 to the smallest backlogged counter (a's 10), not banked idle credit.
    counters.add_waiting("c")
    assert counters.counter("c") == 10.0
    # A tenant that comes back with a counter above the floor keeps its own.
    counters.remove_waiting("b")
    counters.add_waiting("b")
    assert counters.counter("b") == 12.0
    # With nobody backlogged, a newcomer is lifted to the counter of the tenant last chosen, as
    # it is now: the service "a" got after it was chosen counts (not banked as d's credit).
    counters.note_chosen(a)
    for t in ("a", "b", "c"):
        counters.remove_waiting(t)
    counters.charge([_served(_req("a9", "a"), 0, 8, outputs=1)])  # a: 10 + 10 = 20, while running
    counters.add_waiting("d")
    assert counters.counter("d") == 20.0
    assert counters.snapshot() == {"d": 20.0}


def test_idle_tenants_counters_are_pruned_at_the_floor_and_never_gain_by_it():
    from tokenweir.core.policies.fair_share import PRUNE_SLACK
    counters = VirtualTokenCounters(VTCConfig())
    counters.add_waiting("main")
    counters.charge([_served(_req("m", "main", prompt_len=100), 0, 100)])  # main: 100
    # Clients inventing tenant names: each waits once, is admitted, leaves the backlog.
    for i in range(3 * PRUNE_SLACK):
        counters.add_waiting(f"t{i}")  # lifted to the floor (main's 100)
        counters.remove_waiting(f"t{i}")
    assert len(counters.counters) <= 1 + PRUNE_SLACK + 1
    assert counters.counter("main") == 100.0  # backlogged: never pruned
    # A pruned tenant still running is charged from the floor, not from zero.
    gone = next(f"t{i}" for i in range(3 * PRUNE_SLACK) if f"t{i}" not in counters.counters)
    counters.charge([_served(_req("g", gone, prompt_len=5), 0, 5)])
    assert counters.counter(gone) == 105.0
    # One that comes back is lifted to the floor as if never pruned.
    other = next(f"t{i}" for i in range(3 * PRUNE_SLACK) if f"t{i}" not in counters.counters)
    counters.add_waiting(other)
    assert counters.counter(other) == 100.0


def _two_tenants(policy, steps: int = 400):
    """Tenant "heavy" sends 10 requests every 10 steps, "light" 1 per step: both more than the
    engine serves (about one request per step), heavy ten times more."""
    s = create_scheduler(policy=policy, max_num_batched_tokens=32, max_num_seqs=4, num_blocks=256)
    runner = PagedFakeRunner(s.block_size)
    served = {"heavy": 0, "light": 0}
    tenant_of: dict[str, str] = {}
    gaps = []
    for t in range(steps):
        for tenant, count in (("heavy", 100 if t % 10 == 0 else 0), ("light", 1)):
            for _ in range(count):
                rid = tenant_of.setdefault(f"r{len(tenant_of)}", tenant) and f"r{len(tenant_of) - 1}"
                s.add_request(_req(rid, tenant, prompt_len=6, max_tokens=4, arrival=float(t)))
        out = step(s, runner, now=float(t))
        for rid, num in out.num_scheduled_tokens.items():
            served[tenant_of[rid]] += num
        if isinstance(policy, VTCPolicy):
            c = policy.counters
            if c.is_backlogged("heavy") and c.is_backlogged("light"):
                gaps.append(abs(c.counter("heavy") - c.counter("light")))
    s.abort_requests(list(s.requests))
    assert_no_leaks(s)
    return served, gaps


def test_vtc_shares_service_between_a_heavy_and_a_light_tenant_within_its_bound():
    fcfs, _ = _two_tenants("fcfs")
    policy = VTCPolicy()
    vtc, gaps = _two_tenants(policy)
    # Light asks for 1/11 of the work. Under FCFS it gets about that; under VTC, with both
    # backlogged, as much as heavy.
    assert fcfs["light"] / sum(fcfs.values()) < 0.15
    assert 0.45 < vtc["light"] / sum(vtc.values()) < 0.55
    # The bound: |counter difference| <= 2U, U the most one step can charge one tenant
    # (the whole token budget as prompt tokens, or an output token per running sequence).
    cfg = policy.config
    bound = 2 * max(cfg.input_weight * 32, cfg.output_weight * 4)
    assert gaps and max(gaps) <= bound


def test_tenant_weights_set_the_shares():
    policy = VTCPolicy(VTCConfig(tenant_weights={"heavy": 3.0}))
    s = create_scheduler(policy=policy, max_num_batched_tokens=16, max_num_seqs=2, num_blocks=256)
    runner = PagedFakeRunner(s.block_size)
    served = {"heavy": 0, "light": 0}
    for i in range(200):
        s.add_request(_req(f"h{i}", "heavy", 4, 4))
        s.add_request(_req(f"l{i}", "light", 4, 4))
    for t in range(300):
        out = step(s, runner, now=float(t))
        for rid, num in out.num_scheduled_tokens.items():
            served["heavy" if rid.startswith("h") else "light"] += num
    ratio = served["heavy"] / served["light"]
    assert 2.5 < ratio < 3.5
    s.abort_requests(list(s.requests))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arrivals=st.lists(st.tuples(st.integers(0, 40), st.sampled_from([None, "a", "b", "c"]), st.integers(1, 12),
                                   st.integers(1, 6)), min_size=1, max_size=30),
       num_blocks=st.integers(8, 30))
def test_random_workloads_all_finish_correctly_without_leaks(arrivals, num_blocks):
    s = create_scheduler(policy=VTCPolicy(), max_num_batched_tokens=16, max_num_seqs=3, num_blocks=num_blocks)
    runner = PagedFakeRunner(s.block_size)
    pending = sorted(arrivals, key=lambda a: a[0])
    requests, t = [], 0
    while pending or s.has_unfinished_requests():
        while pending and pending[0][0] <= t:
            at, tenant, prompt_len, max_tokens = pending.pop(0)
            requests.append(_req(f"r{len(requests)}", tenant, prompt_len, max_tokens, arrival=float(at)))
            s.add_request(requests[-1])
        step(s, runner, now=float(t))
        t += 1
        assert t < 5000, "no progress"
    for r in requests:
        assert r.output_token_ids == reference_stream(r.prompt_token_ids, r.sampling_params.max_tokens)
    assert_no_leaks(s)
    assert len(s.waiting) == 0 and list(policy_backlog(s)) == []


def policy_backlog(s):
    return s.policy.counters.backlogged


def test_tenant_weights_parse_from_a_flag_or_a_file(tmp_path):
    assert parse_tenant_weights("a=2, b=0.5") == {"a": 2.0, "b": 0.5}
    path = tmp_path / "w.json"
    path.write_text(json.dumps({"gold": 4}))
    assert parse_tenant_weights(f"@{path}") == {"gold": 4.0}
    with pytest.raises(ValueError, match="bad item 'a'"):
        parse_tenant_weights("a")
    with pytest.raises(ValueError, match="weight of 'a' is not a number"):
        parse_tenant_weights("a=x")
    with pytest.raises(ValueError, match="cannot be read as JSON"):
        parse_tenant_weights(f"@{tmp_path / 'missing.json'}")
    path.write_text("[1]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        parse_tenant_weights(f"@{path}")


def test_swapped_requests_come_back_when_the_tenant_furthest_behind_has_none_swapped():
    # The waiting and the swapped queue share the counters: the backlogged tenant with the
    # smallest counter may have requests in only one of them, and each queue must then take
    # from the tenants it holds.
    s = create_scheduler(max_num_batched_tokens=32, max_num_seqs=4, num_blocks=12, block_size=4, policy="vtc",
                         preemption_mode="swap", num_host_blocks=32)
    runner = PagedFakeRunner(4)
    requests = [Request(f"{t}{i}", list(range(1, 13)), SamplingParams(max_tokens=20, ignore_eos=True),
                        arrival_time=0.1 * (t == "b"), eos_token_id=EOS, hints=SchedulingHints(tenant=t))
                for t in "ab" for i in range(3)]
    for r in requests:
        s.add_request(r)
    num_swapped = 0
    for k in range(500):
        if not s.has_unfinished_requests():
            break
        out = step(s, runner, now=float(k))
        num_swapped += len(out.blocks_to_swap_out) > 0
    assert num_swapped  # the case swapped out
    for r in requests:
        assert r.output_token_ids == reference_stream(r.prompt_token_ids, 20)
    assert_no_leaks(s)


@pytest.mark.parametrize("kwargs, message", [
    (dict(scheduling_policy="fcfs", vtc_output_weight=5.0),
     r"vtc_output_weight applies only to scheduling_policy 'vtc', or 'sla' with sla_tenant_fairness, not 'fcfs'$"),
    (dict(scheduling_policy="sla", vtc_tenant_weights="a=2", vtc_input_weight=2.0),
     r"vtc_input_weight, vtc_tenant_weights apply only to .* not 'sla' without it$"),
    (dict(scheduling_policy="vtc", vtc_tenant_weights="a=2,a=3"), r"tenant 'a' is given twice"),
    (dict(scheduling_policy="sla", sla_load_threshold=5.0), r"sla load_threshold must be in \[0, 1\]"),
    (dict(scheduling_policy="fcfs", sla_kv_load_weight=0.5), r"^sla_kv_load_weight only applies to scheduling_policy 'sla'"),
])
def test_vtc_and_load_knobs_that_would_do_nothing_are_refused(kwargs, message):
    from tokenweir.config import EngineArgs

    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs).create_engine_configs(2048, 64)
    EngineArgs(scheduling_policy="sla", sla_tenant_fairness=True, vtc_tenant_weights="a=2").create_engine_configs(2048, 64)


def _sla_defaults() -> dict:
    """sla_<knob>: SLAConfig's default, for every sla knob whose default is a value (not None)."""
    from tokenweir.core.policies import SLAConfig

    return {f"sla_{f.name}": getattr(SLAConfig(), f.name) for f in dataclasses.fields(SLAConfig)
            if f.name not in ("num_priority_classes", "vtc") and getattr(SLAConfig(), f.name) is not None}


VTC_DEFAULTS = {"vtc_input_weight": VTCConfig().input_weight, "vtc_output_weight": VTCConfig().output_weight}


@pytest.mark.parametrize("policy", ["fcfs", "priority", "vtc"])
@pytest.mark.parametrize("arg", sorted(_sla_defaults()))
def test_an_sla_knob_given_at_its_default_is_refused_with_another_policy(policy, arg):
    """Given is given, whatever the value: the default's value would do nothing there too (it was
    accepted once, as equal to the default, while any other value was refused)."""
    from tokenweir.config import EngineArgs

    with pytest.raises(ValueError, match=rf"^{arg} only applies to scheduling_policy 'sla', not '{policy}'$"):
        EngineArgs(scheduling_policy=policy, **{arg: _sla_defaults()[arg]})


@pytest.mark.parametrize("kwargs, tail", [
    (dict(scheduling_policy="fcfs"), "not 'fcfs'"),
    (dict(scheduling_policy="priority"), "not 'priority'"),
    (dict(scheduling_policy="sla"), "not 'sla' without it"),
    (dict(scheduling_policy="sla", sla_tenant_fairness=False), "not 'sla' without it"),
])
@pytest.mark.parametrize("arg", sorted(VTC_DEFAULTS))
def test_a_vtc_knob_given_at_its_default_is_refused_without_vtc(kwargs, tail, arg):
    from tokenweir.config import EngineArgs

    with pytest.raises(ValueError, match=rf"^{arg} applies only to scheduling_policy 'vtc', or 'sla' with "
                                         rf"sla_tenant_fairness, {tail}$"):
        EngineArgs(**kwargs, **{arg: VTC_DEFAULTS[arg]})


def test_knobs_given_at_their_defaults_with_their_policy_yield_the_default_configs():
    from tokenweir.config import EngineArgs
    from tokenweir.core.policies import SLAConfig

    def policy_config(**kwargs):
        return EngineArgs(**kwargs).create_engine_configs(2048, 64)[1].policy_config

    assert policy_config(scheduling_policy="sla", **_sla_defaults()) == SLAConfig()
    assert policy_config(scheduling_policy="sla") == SLAConfig()
    assert policy_config(scheduling_policy="vtc", **VTC_DEFAULTS) == VTCConfig() == policy_config(scheduling_policy="vtc")
    assert (policy_config(scheduling_policy="sla", sla_tenant_fairness=True, **VTC_DEFAULTS)
            == SLAConfig(tenant_fairness=True))


def test_served_idle_tenants_are_pruned_too_and_the_floor_survives_it():
    from tokenweir.core.policies.fair_share import PRUNE_SLACK
    counters = VirtualTokenCounters(VTCConfig())
    counters.add_waiting("main")  # backlogged throughout: the floor stays at its counter, 0
    passes = 0
    prune = counters._prune

    def counted() -> None:
        nonlocal passes
        passes += 1
        prune()

    counters._prune = counted
    n = 10 * PRUNE_SLACK
    for i in range(n):  # each invented tenant is served, so it sits above the floor
        counters.add_waiting(f"t{i}")
        counters.charge([_served(_req(f"r{i}", f"t{i}", prompt_len=3), 0, 3)])
        counters.remove_waiting(f"t{i}")
    assert len(counters.counters) <= 1 + PRUNE_SLACK + 1
    assert passes <= 2 * n // PRUNE_SLACK + 1  # amortized: a pass per PRUNE_SLACK / 2 tenants
    # The tenant chosen last, pruned, must not drag the floor of an empty backlog to 0.
    counters.note_chosen(_req("r0", "t0"))  # long pruned
    counters.counters["t0"] = 50.0  # charged again (from the floor) while running
    counters.remove_waiting("main")
    counters._prune()
    del counters.counters["t0"]
    counters._prune()  # a second pass after it left again: the kept value holds
    counters.add_waiting("new")
    assert counters.counter("new") == 50.0


def test_a_step_s_admissions_alternate_between_tenants_as_each_admission_is_counted():
    # Charged only after the step, the tenant behind took every slot of a step (a0..a7 here);
    # each admission counts its prompt provisionally, so the step alternates, as VTC's
    # admission-time charge does, and the step's charge then counts what was computed.
    policy = VTCPolicy()
    s = create_scheduler(policy=policy, max_num_batched_tokens=256, max_num_seqs=8, num_blocks=512)
    for i in range(8):
        s.add_request(_req(f"a{i}", "A", prompt_len=16))
        s.add_request(_req(f"b{i}", "B", prompt_len=16))
    runner = PagedFakeRunner(s.block_size)
    out = step(s, runner, now=0.0)
    assert list(out.num_scheduled_tokens) == ["a0", "b0", "a1", "b1", "a2", "b2", "a3", "b3"]
    # What was computed, charged once: 4 prompts of 16 and each one's first token (weight 2).
    assert policy.counters.counter("A") == policy.counters.counter("B") == 4 * 16 + 4 * 2
    s.abort_requests(list(s.requests))
    assert_no_leaks(s)


@pytest.mark.parametrize("make_queue", ["vtc", "sla"])
def test_a_request_put_back_keeps_its_tenant_s_counter_only_an_arrival_is_lifted(make_queue):
    # A's only request was taken for admission (A leaves the backlog), ran a chunk (A = 10)
    # while B, backlogged, was served 500. Preempted, it goes back to wait: A was not idle and
    # is owed that service, so no lift to B's 500 (which erased it); a new arrival of an idle
    # tenant is still lifted.
    from tokenweir.core.policies import SLAConfig, SLAPolicy
    policy = VTCPolicy() if make_queue == "vtc" else SLAPolicy(SLAConfig(tenant_fairness=True))
    queue, counters = policy.make_waiting_queue(), policy.counters
    a, b = _req("a", "A", prompt_len=10), _req("b", "B", prompt_len=500)
    queue.add(a)
    queue.add(b)
    assert queue.pop() is a  # ties: the earlier entry
    assert counters.counter("A") == 10.0  # its prompt, provisionally (this step)
    policy.end_step(0.0)  # the step is scheduled: the provisional part goes
    assert counters.counter("A") == 0.0
    counters.charge([_served(a, 0, 10), _served(_req("b-old", "B", prompt_len=500), 0, 500)])
    assert (counters.counter("A"), counters.counter("B")) == (10.0, 500.0)
    a.max_computed_tokens = 10
    queue.push_front(a)  # a recompute preemption
    assert counters.counter("A") == 10.0 and counters.is_backlogged("A")
    assert queue.pop() is a and counters.counter("A") == 10.0  # nothing left to charge: computed before
    queue.push_front(a)  # passed over in the same step: its (zero) provisional charge undone
    assert counters.counter("A") == 10.0
    queue.add(_req("c", "C"))  # an idle tenant arriving: lifted to the smallest backlogged (A)
    assert counters.counter("C") == 10.0


def test_a_provisional_charge_is_taken_back_when_the_request_goes_back_and_replaced_by_the_computed():
    counters = VirtualTokenCounters(VTCConfig(input_weight=1.0, tenant_weights={"gold": 2.0}))
    queue = VTCPolicy(counters.config).make_waiting_queue()
    counters = queue.counters
    r = _req("g", "gold", prompt_len=40)
    queue.add(r)
    assert queue.pop() is r and counters.counter("gold") == 20.0  # 40 prompt tokens at weight 2
    queue.push_front(r)
    assert counters.counter("gold") == 0.0
    assert queue.pop() is r
    counters.drop_provisional()  # the step is scheduled
    counters.charge([_served(r, 0, 16)])  # a 16-token first chunk: what is charged
    assert counters.counter("gold") == 8.0


@pytest.mark.parametrize("running_tenant,waiting_tenant,displaced", [("light", "heavy", False), ("heavy", "light", True)])
def test_sla_with_tenant_fairness_preempts_across_tenants_only_for_the_tenant_behind(running_tenant, waiting_tenant,
                                                                                   displaced):
    # One class, one slot. The waiting request's urgency (a TTFT SLO) outscores the running one
    # by more than the margin; with tenant fairness the queue ranks tenants by VTC before
    # scores, and so does preemption: "heavy", 5,000 units ahead, no longer displaces the
    # tenant furthest behind (it did, and the victim's tenant then counted as far ahead).
    from tokenweir.core.policies import SLAConfig, SLAPolicy
    policy = SLAPolicy(SLAConfig(tenant_fairness=True))
    s = create_scheduler(policy=policy, max_num_batched_tokens=16, max_num_seqs=1, num_blocks=64)
    runner = PagedFakeRunner(s.block_size)
    s.add_request(Request("running", list(range(3000, 3004)), SamplingParams(max_tokens=40), arrival_time=0.0,
                          eos_token_id=EOS, hints=SchedulingHints(tenant=running_tenant)))
    step(s, runner, now=0.0)
    policy.counters.charge([_served(_req("old", "heavy", prompt_len=5000), 0, 5000)])
    s.add_request(Request("waiting", list(range(7000, 7004)), SamplingParams(max_tokens=4), arrival_time=0.05,
                          eos_token_id=EOS, hints=SchedulingHints(tenant=waiting_tenant, ttft_slo=0.5)))
    preempted = set()
    for i in range(1, 20):
        preempted |= step(s, runner, now=0.1 * i).preempted_req_ids
    assert preempted == ({"running"} if displaced else set())
    s.abort_requests(list(s.requests))
    assert_no_leaks(s)


def test_a_failed_step_s_provisional_charges_are_dropped_at_the_next_step():
    # A step that fails is never charged: its admissions' provisional charges must not stay in
    # the counters (they ranked their tenant behind, and lifted a tenant arriving meanwhile).
    policy = VTCPolicy()
    s = create_scheduler(policy=policy, max_num_batched_tokens=64, max_num_seqs=4, num_blocks=64)
    s.add_request(_req("a", "A", prompt_len=16))
    s.add_request(_req("b", "B", prompt_len=16))
    out = s.schedule(now=0.0)
    assert policy.counters.counter("A") == policy.counters.counter("B") == 0.0  # only while scheduling
    s.fail_step(out, now=0.0)
    s.add_request(_req("c", "A", prompt_len=8))  # lifted to B's 0, nothing of the failed step
    out = step(s, PagedFakeRunner(s.block_size), now=1.0)
    assert list(out.num_scheduled_tokens) == ["c"]
    assert policy.counters.counter("A") == 8.0 + 2.0 and policy.counters.counter("B") == 0.0
    s.abort_requests(list(s.requests))
    assert_no_leaks(s)


def test_a_newly_backlogged_tenant_keeps_its_heap_entry_when_its_push_rebuilds_the_heap():
    # The push that backlogs a tenant may be the one that rebuilds the heap from the backlogged
    # tenants: the tenant must be among them by then (it was not: min_backlogged raised
    # LookupError, or skipped it for a tenant further ahead).
    counters = VirtualTokenCounters(VTCConfig())
    counters.add_waiting("c")
    counters.charge([_served(_req("c-old", "c", prompt_len=500), 0, 500)])
    counters.add_waiting("a")
    r = _req("x", "a", prompt_len=20)
    for _ in range(500):  # a passed over again and again, as in a step's lookahead
        if len(counters._heap) >= 4 * 1 + 64:  # the next push, with c alone backlogged, rebuilds
            break
        counters.remove_waiting("a")
        counters.charge_admission(r)
        counters.put_back(r)
    counters.remove_waiting("a")
    counters.add_waiting("b")  # lifted to c's 500; its push reaches the rebuild threshold
    assert counters.counter("b") == 500.0
    counters.charge([_served(_req("c-more", "c", prompt_len=10), 0, 10)])
    assert counters.min_backlogged() == "b"  # c is ahead now


def test_sla_with_tenant_fairness_looks_past_victims_the_tenant_rule_keeps():
    # The scheduler stops at the first victim refused. c0 scores lowest but its tenant is not
    # ahead of a's; b's is, far: a0 (urgent) displaces b0 (it was refused on c0 and never
    # asked about b0).
    import dataclasses

    from tests.core.helpers import make_request
    from tokenweir.core.policies import SLAConfig, SLAPolicy
    policy = SLAPolicy(SLAConfig(tenant_fairness=True, protect_slos=False))
    s = create_scheduler(policy=policy, max_num_batched_tokens=64, max_num_seqs=2, num_blocks=256)
    runner = PagedFakeRunner(s.block_size)
    s.add_request(make_request("b0", 8, tenant="b", max_tokens=500, ignore_eos=True, arrival_time=0.0))
    s.add_request(make_request("c0", 8, tenant="c", max_tokens=500, ignore_eos=True, arrival_time=1.0))
    for t in range(1, 6):
        step(s, runner, now=float(t))
    policy.counters.counters["b"] += 1000.0  # b served far more before
    a = make_request("a0", 8, tenant="a", max_tokens=2, arrival_time=5.95, ignore_eos=True)
    a.hints = dataclasses.replace(a.hints, ttft_slo=0.05)  # urgent: outscores both by the margin
    s.add_request(a)
    out = step(s, runner, now=6.0)
    assert out.preempted_req_ids == {"b0"} and "a0" in out.num_scheduled_tokens
    s.abort_requests(list(s.requests))
    assert_no_leaks(s)


def test_a_request_put_back_is_not_the_last_chosen():
    # The lift with nobody backlogged reads the tenant chosen last; one taken and put back (a
    # full batch trying its head) was not chosen: the tenant chosen before it stays the one.
    counters = VirtualTokenCounters(VTCConfig())
    a, b = _req("a", "a"), _req("b", "b")
    counters.add_waiting("a")
    counters.add_waiting("b")
    counters.charge([_served(b, 0, 4)])  # b: 4, a: 0
    counters.note_chosen(a)
    counters.remove_waiting("a")
    counters.note_chosen(b)  # taken to be tried (as a queue's pop does) ...
    counters.remove_waiting("b")
    counters.put_back(b)  # ... and put back
    counters.remove_waiting("b")  # then aborted: nobody is backlogged
    counters.add_waiting("c")
    assert counters.counter("c") == 0.0  # a's counter, not b's 4

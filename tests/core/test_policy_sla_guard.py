"""The SLO guard of `sla` (core/policies/sla_guard.py): hand-computed decisions, the step it
keeps a batch prefill out of, and the wait bound with the guard acting."""

from __future__ import annotations

import json
from collections import deque

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.helpers import EOS, PagedFakeRunner, assert_no_leaks, create_scheduler, reference_stream
from tokenweir.core.cost_model import FEATURES, StepCostModel, StepTally, chunk_composition, step_composition
from tokenweir.core.policies import SLAConfig, SLAPolicy
from tokenweir.core.policies.sla_guard import SLOGuard
from tokenweir.request import Request, RequestStatus, SamplingParams, SchedulingHints

# A step costs 10 ms plus 1 ms per token (a prefill token or a decode row): easy to add by hand.
STEP, PER_TOKEN = 0.010, 0.001
COST = StepCostModel({**{name: 0.0 for name in FEATURES}, "step": STEP, "tokens": PER_TOKEN}, 1e9)


def _req(rid: str, prompt_len: int, max_tokens: int, arrival: float = 0.0, **hints) -> Request:
    base = 1000 + 50 * (sum(map(ord, rid)) % 1000)
    return Request(rid, list(range(base, base + prompt_len)), SamplingParams(max_tokens=max_tokens),
                   arrival_time=arrival, eos_token_id=EOS, hints=SchedulingHints(**hints))


def _decoding(rid: str, first_token_at: float, num_outputs: int, max_tokens: int, tpot_slo: float) -> Request:
    """An interactive request running its decode: prompt 10, `num_outputs` tokens so far, the
    first at `first_token_at`, all but the last computed."""
    r = _req(rid, 10, max_tokens, priority=0, tpot_slo=tpot_slo)
    for i in range(num_outputs):
        r.append_output_token(7, first_token_at + 0.001 * i)
    r.first_token_time = first_token_at
    r.status = RequestStatus.RUNNING
    r.num_computed_tokens = r.num_tokens - 1
    return r


def _admits(guard: SLOGuard, request: Request) -> bool:
    """The guard's verdict as the scheduler asks it when no cap or cache hit shortens a chunk:
    each running request computes all it has left, the candidate all its prompt."""
    step = StepTally()
    for r in guard._running:
        step.add(chunk_composition(r.num_tokens - r.num_computed_tokens, r.num_computed_tokens, r.num_tokens,
                                   r.num_prompt_tokens))
    return guard.admits(request, request.num_tokens - request.num_computed_tokens, request.num_computed_tokens,
                        step)


def _guard(now: float, running: list[Request]) -> SLOGuard:
    guard = SLOGuard(COST, num_classes=4)
    guard.begin_step(now, running)
    return guard


def test_a_batch_prefill_that_would_break_a_decoding_request_s_mean_tpot_is_refused():
    # First token at 1.0, 3 so far: the next keeps the mean TPOT <= 50 ms if it comes by
    # 1.0 + 0.05 * 3 = 1.15. At now = 1.1 the step is one decode row: t0 = 10 + 1 = 11 ms.
    inter = _decoding("i", 1.0, 3, 10, tpot_slo=0.05)
    guard = _guard(1.1, [inter])
    # 30 prompt tokens: t1 = 10 + 31 = 41 ms, 1.141 <= 1.15: in.
    assert _admits(guard, _req("b30", 30, 4, priority=1))
    # 40 tokens: t1 = 51 ms, 1.151 > 1.15, and the SLO can still be met (6 more decodes of
    # 11 ms end at 1.1 + 0.011 + 0.066 = 1.177 <= 1.0 + 0.05 * 9 = 1.45): refused.
    assert not _admits(guard, _req("b40", 40, 4, priority=1))
    assert guard.num_refused == 1 and guard.last_refusal == ("b40", "i", "TPOT")
    # Nothing is more important than class 0, and a request of its own class is not held back.
    assert _admits(guard, _req("i40", 40, 4, priority=0, tpot_slo=0.05))
    assert _admits(_guard(1.1, [_decoding("j", 1.0, 3, 10, tpot_slo=0.05)]), _req("c", 40, 4, priority=0))


def test_a_request_behind_that_can_catch_up_is_protected_and_a_hopeless_one_is_not():
    # Behind: the next token was due by 1.0 + 0.02 * 3 = 1.06 < now. It can still catch up:
    # 16 more decodes of 11 ms end at 1.1 + 0.011 + 0.176 = 1.287 <= 1.0 + 0.02 * 19 = 1.38.
    assert not _admits(_guard(1.1, [_decoding("i", 1.0, 3, 20, tpot_slo=0.02)]), _req("b", 5, 4, priority=1))
    # Hopeless: with 6 more decodes the end is 1.177 > 1.0 + 0.01 * 9 = 1.09.
    assert _admits(_guard(1.1, [_decoding("i", 1.0, 3, 10, tpot_slo=0.01)]), _req("b", 5, 4, priority=1))


def test_a_batch_prefill_that_would_make_an_interactive_prefill_miss_its_ttft_is_refused():
    # The interactive prompt of 20 tokens runs its prefill now (t0 = 10 + 20 = 30 ms), due by 50 ms.
    inter = _req("i", 20, 4, priority=0, ttft_slo=0.05)
    inter.status = RequestStatus.RUNNING
    assert _admits(_guard(0.0, [inter]), _req("b10", 10, 4, priority=1))  # t1 = 40 ms
    assert not _admits(_guard(0.0, [inter]), _req("b30", 30, 4, priority=1))  # t1 = 60 ms
    # A TTFT already out of reach without the batch prefill is not protected.
    late = _req("late", 20, 4, priority=0, ttft_slo=0.02)
    late.status = RequestStatus.RUNNING
    assert _admits(_guard(0.0, [late]), _req("b30", 30, 4, priority=1))


def test_the_guard_sees_requests_admitted_during_the_step_and_recounts_after_a_victim_leaves():
    running: list[Request] = []
    guard = _guard(0.0, running)
    assert _admits(guard, _req("b", 30, 4, priority=1))  # nothing more important runs
    inter = _req("i", 20, 4, priority=0, ttft_slo=0.05)
    inter.status = RequestStatus.RUNNING
    running.append(inter)  # the scheduler admitted it
    assert not _admits(guard, _req("b", 30, 4, priority=1))
    running.remove(inter)  # preempted
    assert _admits(guard, _req("b", 30, 4, priority=1))


def test_the_policy_holds_back_what_the_guard_refuses_and_an_aged_request_passes(tmp_path):
    policy = SLAPolicy(SLAConfig(max_wait=10.0, cost_profile=_profile(tmp_path)))
    inter = _req("i", 20, 4, priority=0, ttft_slo=0.05)
    inter.status = RequestStatus.RUNNING
    policy.begin_step(0.0, policy.make_waiting_queue(), [inter])
    batch = _req("b", 30, 4, priority=1)
    step = StepTally()
    step.add(chunk_composition(20, 0, 20, 20))  # i's prompt
    assert not policy.may_admit(batch, 30, 0, step, 0.0)  # its prefill would make i miss its TTFT
    assert policy.may_admit(batch, 30, 0, step, 10.0)  # it has waited max_wait: the wait bound wins
    assert SLAPolicy(SLAConfig(protect_slos=False)).may_admit(batch, 30, 0, step, 0.0)


def _profile(tmp_path) -> str:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(COST.to_dict()))
    return str(path)


def _run(s, requests: list[Request], until: float = 1000.0, check=None) -> list:
    """Drive `s` as the simulator does: arrivals by their time, each step lasting its predicted
    time; returns the steps' scheduled ids. `check(out, now)` sees every step as scheduled."""
    runner = PagedFakeRunner(s.block_size)
    pending = deque(sorted(requests, key=lambda r: r.arrival_time))
    steps, now = [], 0.0
    while pending or s.has_unfinished_requests():
        while pending and pending[0].arrival_time <= now:
            s.add_request(pending.popleft())
        if not s.has_unfinished_requests():
            now = pending[0].arrival_time
            continue
        out = s.schedule(now=now)
        if check is not None:
            check(out, now)
        steps.append(set(out.num_scheduled_tokens))
        now += COST.predict(step_composition(out, s.requests))
        s.update_from_output(out, runner.execute(out), now=now)
        assert now < until, "no progress"
    return steps


def test_a_batch_prompt_arriving_with_an_interactive_one_waits_for_its_first_token(tmp_path):
    """The defect: the budget held both prompts, so sla put them into one step of 10 + 60 ms
    and the interactive request, due in 50 ms, missed its TTFT for a batch request's prefill."""
    inter = _req("i", 20, 3, priority=0, ttft_slo=0.05, tpot_slo=0.5)
    batch = _req("b", 40, 3, priority=1, ttft_slo=60.0)
    s = create_scheduler(policy=SLAPolicy(SLAConfig(cost_profile=_profile(tmp_path))), max_num_batched_tokens=64,
                         max_num_seqs=4, num_blocks=64)
    steps = _run(s, [inter, batch])
    assert steps[0] == {"i"} and "b" in steps[1]
    assert inter.first_token_time - inter.arrival_time <= 0.05  # 10 + 20 ms
    for r in (inter, batch):
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == reference_stream(r.prompt_token_ids, 3)
    assert_no_leaks(s)
    assert s.get_stats().policy["slo_guard_refusals"] >= 1


def test_without_the_guard_the_batch_prefill_shares_the_step_and_the_ttft_is_missed(tmp_path):
    inter = _req("i", 20, 3, priority=0, ttft_slo=0.05)
    batch = _req("b", 40, 3, priority=1)
    s = create_scheduler(policy=SLAPolicy(SLAConfig(protect_slos=False)), max_num_batched_tokens=64,
                         max_num_seqs=4, num_blocks=64)
    steps = _run(s, [inter, batch])
    assert steps[0] == {"i", "b"} and inter.first_token_time - inter.arrival_time > 0.05
    assert_no_leaks(s)


def test_a_batch_request_waits_while_decodes_have_no_slack_and_runs_when_they_do(tmp_path):
    """An interactive request decoding at a TPOT SLO of 12 ms (a decode step is 11 ms): a
    40-token batch prompt (a 51 ms step) would break its pace, so it waits until the
    interactive request has finished; with a TPOT SLO of 40 ms, it has banked time enough
    after a few tokens and the batch prompt is admitted while it decodes."""
    for tpot, admitted_while_decoding in ((0.012, False), (0.040, True)):
        inter = _req("i", 5, 30, priority=0, tpot_slo=tpot)
        batch = _req("b", 40, 3, arrival=0.05, priority=1)
        s = create_scheduler(policy=SLAPolicy(SLAConfig(cost_profile=_profile(tmp_path))),
                             max_num_batched_tokens=64, max_num_seqs=4, num_blocks=64)
        steps = _run(s, [inter, batch])
        together = any({"i", "b"} <= ids for ids in steps)
        assert together == admitted_while_decoding, tpot
        assert (inter.finished_time - inter.first_token_time) / 29 <= tpot
        assert batch.status == RequestStatus.FINISHED_LENGTH
        assert_no_leaks(s)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(arrivals=st.lists(st.tuples(st.integers(0, 200).map(lambda centis: centis / 100), st.integers(0, 3),
                                   st.integers(1, 30), st.integers(1, 12), st.sampled_from([None, 0.02, 0.2]),
                                   st.sampled_from([None, 0.012, 0.03])), min_size=1, max_size=30),
       max_wait=st.sampled_from([0.5, 2.0]), num_blocks=st.integers(12, 40))
def test_with_the_guard_no_request_waits_past_the_bound_behind_younger_ones_and_none_starves(
        tmp_path, arrivals, max_wait, num_blocks):
    """Random mixes of classes and tight SLOs on a clock that advances by each step's predicted
    time (so the guard decides for real): once a request has waited max_wait no younger one is
    admitted before it, everything finishes with the reference output, nothing leaks."""
    policy = SLAPolicy(SLAConfig(max_wait=max_wait, cost_profile=_profile(tmp_path)))
    s = create_scheduler(policy=policy, max_num_batched_tokens=32, max_num_seqs=3, num_blocks=num_blocks)
    requests = [_req(f"r{i}", prompt, out, arrival=at, priority=prio, ttft_slo=ttft, tpot_slo=tpot)
                for i, (at, prio, prompt, out, ttft, tpot) in enumerate(arrivals)]

    def no_younger_admitted_past_an_aged_one(out, now):
        admitted = [s.requests[n.request_id] for n in out.scheduled_new_reqs]
        young = [r for r in admitted if now - r.arrival_time < max_wait]
        left_aged = [r for r in s.waiting if now - r.arrival_time >= max_wait]
        assert not (young and left_aged), (now, [r.request_id for r in young], [r.request_id for r in left_aged])

    _run(s, requests, until=100.0, check=no_younger_admitted_past_an_aged_one)
    for r in requests:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == reference_stream(r.prompt_token_ids, r.num_output_tokens)
        assert r.num_output_tokens == r.sampling_params.max_tokens
    assert_no_leaks(s)


def test_the_guard_s_knobs_come_from_the_engine_args_and_a_bad_profile_is_refused_with_why(tmp_path):
    from tokenweir.config import EngineArgs

    _, sched = EngineArgs(scheduling_policy="sla", sla_protect_slos=False,
                          sla_cost_profile=_profile(tmp_path)).create_engine_configs(2048, 64)
    assert sched.policy_config.protect_slos is False and sched.policy_config.cost_profile == _profile(tmp_path)
    assert SLAPolicy(SLAConfig(protect_slos=False)).guard is None
    with pytest.raises(ValueError, match="cost profile /no/such.json does not exist"):
        SLAPolicy(SLAConfig(cost_profile="/no/such.json"))
    with pytest.raises(ValueError, match="sla cost_profile must be a path"):
        SLAConfig(cost_profile=3)
    with pytest.raises(ValueError, match="sla protect_slos must be true or false"):
        SLAConfig(protect_slos="yes")


def _steps(s, runner, now, n):
    for _ in range(n):
        out = s.schedule(now)
        now += COST.predict(step_composition(out, s.requests))
        s.update_from_output(out, runner.execute(out), now)
    return now


def test_the_step_view_is_recounted_after_a_one_for_one_preemption(tmp_path):
    # X takes V's slot (one victim, one admission: the running list keeps its length); the
    # guard must then count X and not V, and refuse Y, whose prefill would make I late.
    s = create_scheduler(policy=SLAPolicy(SLAConfig(cost_profile=_profile(tmp_path))), max_num_batched_tokens=256,
                         max_num_seqs=3, num_blocks=200)
    runner = PagedFakeRunner(s.block_size)
    for rid in ("V", "W"):
        s.add_request(_req(rid, 4, 40, priority=2))
    now = _steps(s, runner, 0.0, 3)
    inter = _req("I", 20, 3, arrival=now, priority=0, ttft_slo=0.065)
    for r in (inter, _req("X", 30, 3, arrival=now, priority=1), _req("Y", 30, 3, arrival=now, priority=1)):
        s.add_request(r)
    out = s.schedule(now)
    assert "Y" not in out.num_scheduled_tokens and {"I", "X"} <= set(out.num_scheduled_tokens)
    now += COST.predict(step_composition(out, s.requests))
    s.update_from_output(out, runner.execute(out), now)
    assert inter.first_token_time - inter.arrival_time <= 0.065


def test_the_guard_sees_the_chunks_the_step_gives_not_what_running_requests_have_left(tmp_path):
    # B prefills 2,000 tokens 16 at a time: counting all it has left would make I's TTFT look
    # lost already (so unprotected); its 16-token chunk leaves I on time, unless C joins.
    s = create_scheduler(policy=SLAPolicy(SLAConfig(cost_profile=_profile(tmp_path))), max_num_batched_tokens=256,
                         max_num_seqs=8, num_blocks=1000, long_prefill_token_threshold=16)
    runner = PagedFakeRunner(s.block_size)
    s.add_request(_req("B", 2000, 3, priority=1))
    now = _steps(s, runner, 0.0, 2)
    inter = _req("I", 12, 3, arrival=now, priority=0, ttft_slo=0.045)
    s.add_request(inter)
    s.add_request(_req("C", 30, 3, arrival=now, priority=1))
    out = s.schedule(now)
    assert set(out.num_scheduled_tokens) == {"B", "I"}  # 10 + 16 + 12 = 38 ms; with C 54 ms


def test_a_swapped_request_held_back_does_not_hold_back_more_important_arrivals(tmp_path):
    # B (batch) is swapped out for I1; the guard keeps it out while I0 decodes on a tight
    # TPOT. I2 arrives later with a TTFT SLO: the swapped B, held back, must not block it.
    B = _req("B", 300, 5, priority=1)
    I0 = _req("I0", 5, 150, arrival=0.01, priority=0, tpot_slo=0.012)
    I1 = _req("I1", 5, 2, arrival=0.05, priority=0, ttft_slo=1.0)
    I2 = _req("I2", 5, 3, arrival=0.30, priority=0, ttft_slo=0.1)
    s = create_scheduler(policy=SLAPolicy(SLAConfig(cost_profile=_profile(tmp_path))), max_num_batched_tokens=64,
                         max_num_seqs=2, num_blocks=200, preemption_mode="swap", num_host_blocks=200)
    _run(s, [B, I0, I1, I2])
    assert B.num_preemptions >= 1 and s.policy.guard.num_refused > 0  # the case arose
    assert I2.first_token_time - I2.arrival_time <= 0.1
    for r in (B, I0, I1, I2):
        assert r.output_token_ids == reference_stream(r.prompt_token_ids, r.num_output_tokens)
    assert_no_leaks(s)


def test_the_policy_is_not_asked_while_no_admission_is_possible(tmp_path):
    # A full batch that nobody may be preempted from: the guard's view (a pass over the
    # running requests) is never built.
    policy = SLAPolicy(SLAConfig(cost_profile=_profile(tmp_path)))
    asked = []
    policy.may_admit = lambda *args: asked.append(args) or True
    s = create_scheduler(policy=policy, max_num_batched_tokens=256, max_num_seqs=4, num_blocks=400)
    runner = PagedFakeRunner(s.block_size)
    for i in range(4):
        s.add_request(_req(f"r{i}", 8, 50, priority=1))
    now = _steps(s, runner, 0.0, 2)
    asked.clear()
    for i in range(10):
        s.add_request(_req(f"w{i}", 8, 5, arrival=now, priority=1))
    _steps(s, runner, now, 5)
    assert asked == []


def test_sla_knobs_with_another_policy_are_refused_with_why():
    from tokenweir.config import EngineArgs

    with pytest.raises(ValueError, match=r"sla_protect_slos, sla_cost_profile only apply to scheduling_policy .sla., "
                                         r"not 'priority'"):
        EngineArgs(scheduling_policy="priority", sla_protect_slos=False,
                   sla_cost_profile="x.json").create_engine_configs(2048, 64)
    EngineArgs(scheduling_policy="priority").create_engine_configs(2048, 64)  # the defaults are fine

"""`sla` with drop_unmeetable: requests whose deadline the step cost model says cannot be met are
shed before it passes, with the reason; hand-computed bounds, a preempted request, and a random
check that nobody shed could have finished in time even alone (and that nothing leaks)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Optional

import pytest

from tests.core.helpers import PagedFakeRunner, assert_no_leaks, create_scheduler, reference_stream
from tokenweir.config import EngineArgs
from tokenweir.core.cost_model import FEATURES, RemainingWork, StepCostModel, step_composition
from tokenweir.core.policies import SLAConfig, SLAPolicy
from tokenweir.core.scheduler import Scheduler, SchedulerOutput
from tokenweir.core.step_timing import CORRECTION_GAIN, LOW_RATIO_MIN_STEPS
from tokenweir.request import Request, RequestStatus, SamplingParams, SchedulingHints

# Hand-computable: a step costs 10 ms plus 1 ms per token it computes (nothing else counts).
COST = StepCostModel({**dict.fromkeys(FEATURES, 0.0), "step": 0.010, "tokens": 0.001}, swap_bytes_per_second=1e9)


def _scaled(factor: float) -> StepCostModel:
    """COST on a machine `factor` times as slow (its steps take `factor` x COST's time)."""
    return StepCostModel({k: v * factor for k, v in COST.coefficients.items()}, swap_bytes_per_second=1e9)


def _profile(tmp_path: Path, model: StepCostModel = COST) -> str:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(model.to_dict()))
    return str(path)


def _policy(tmp_path: Path, **kw) -> SLAPolicy:
    # The profile is the machine here: trusted as it is (no correction), so judged from step 0.
    kw.setdefault("step_time_correction", False)
    return SLAPolicy(SLAConfig(drop_unmeetable=True, cost_profile=_profile(tmp_path), **kw))


def _req(rid: str, prompt: list[int], deadline: Optional[float], arrival: float = 0.0, priority: int = 0,
         **params) -> Request:
    return Request(rid, prompt, SamplingParams(**params), arrival_time=arrival,
                   hints=SchedulingHints(priority=priority, deadline=deadline))


def _step(s: Scheduler, runner: PagedFakeRunner, now: float, cost: StepCostModel = COST) -> tuple[SchedulerOutput, float]:
    """One step on the cost model's clock: it ends `predict(its composition)` after `now`."""
    out = s.schedule(now=now)
    end = now + cost.predict(step_composition(out, s.requests, s.cache_config.kv_block_bytes))
    s.update_from_output(out, runner.execute(out), now=end)
    return out, end


def _tokens(n: int, base: int) -> list[int]:
    return list(range(base, base + n))


def test_hand_computed_bounds_shed_at_once_and_keep_what_fits(tmp_path):
    s = create_scheduler(policy=_policy(tmp_path), max_num_batched_tokens=128, max_num_seqs=4, num_blocks=128)
    runner = PagedFakeRunner(s.block_size)
    # 40 prompt tokens, exactly 8 outputs (ignore_eos, no stops): alone, one 50 ms step (10 + 40)
    # and 7 decode steps of 11 ms: 127 ms; x 0.8 = 101.6 ms.
    params = dict(max_tokens=8, ignore_eos=True, temperature=0.0)
    out_of_reach = _req("out", _tokens(40, 1000), deadline=0.100, **params)
    inside = _req("inside", _tokens(40, 2000), deadline=0.104, **params)
    for r in (out_of_reach, inside):
        s.add_request(r)
    out, now = _step(s, runner, 0.0)
    assert out_of_reach.status == RequestStatus.FINISHED_ABORTED and out_of_reach.finished_time == 0.0
    assert out_of_reach.status_message.startswith("deadline cannot be met: needs at least 101.6 ms, 100.0 ms left "
                                                  "of its 100 ms deadline (estimated: 0.8 x the step cost "
                                                  "model's 127.0 ms for its 40 tokens left to compute")
    assert "out" in out.finished_req_ids and out.num_scheduled_tokens == {"inside": 40}
    assert s.policy.get_stats()["deadline_shed"] == {"expired": 0, "unmeetable": 1}
    # Inside the margin, it is served until its bound no longer fits: after its 50 ms prefill
    # with 7 tokens to go, 0.8 x 77 ms = 61.6 ms > the 54 ms left.
    assert inside.num_output_tokens == 1 and now == pytest.approx(0.05)
    _step(s, runner, now)
    assert inside.is_finished and inside.status_message.startswith(
        "deadline cannot be met: needs at least 61.6 ms, 54.0 ms left")
    assert_no_leaks(s)

    # One that fits alone is served to its end, its greedy tokens those of a run alone.
    fits = _req("fits", _tokens(40, 3000), deadline=0.128, arrival=now, **params)
    s.add_request(fits)
    while s.has_unfinished_requests():
        _, now = _step(s, runner, now)
    assert fits.status == RequestStatus.FINISHED_LENGTH and fits.finished_time <= fits.deadline
    assert fits.output_token_ids == reference_stream(fits.prompt_token_ids, 8)
    # Its prefix is cached now: the same prompt needs one 4-token chunk (10 + 4 ms) and the 7
    # decodes, 91 ms (x 0.8 = 72.8): a deadline of 95 ms is met; without the hit it would not fit.
    again = _req("again", list(fits.prompt_token_ids), deadline=0.095, arrival=now, **params)
    s.add_request(again)
    start = now
    while s.has_unfinished_requests():
        _, now = _step(s, runner, now)
    assert again.status == RequestStatus.FINISHED_LENGTH and again.num_cached_tokens == 36
    assert now - start == pytest.approx(0.091) and again.output_token_ids == fits.output_token_ids
    assert s.policy.get_stats()["deadline_shed"] == {"expired": 0, "unmeetable": 2}
    assert_no_leaks(s)


def test_the_bound_counts_min_tokens_not_max_tokens_unless_nothing_can_stop_it(tmp_path):
    s = create_scheduler(policy=_policy(tmp_path), max_num_batched_tokens=128, num_blocks=128)
    cases = {"may_stop": dict(max_tokens=50), "min_tokens": dict(max_tokens=50, min_tokens=20),
             "runs_to_max": dict(max_tokens=50, ignore_eos=True),
             "stop_id": dict(max_tokens=50, ignore_eos=True, stop_token_ids=[7]),
             "stop_string": dict(max_tokens=50, ignore_eos=True, stop=["x"])}
    requests = {rid: _req(rid, _tokens(10, 1000 * i), deadline=10.0, **p) for i, (rid, p) in enumerate(cases.items())}
    for r in requests.values():
        s.add_request(r)
    samples = {rid: s.least_remaining_work(r).num_samples for rid, r in requests.items()}
    assert samples == {"may_stop": 1, "min_tokens": 20, "runs_to_max": 50, "stop_id": 1, "stop_string": 1}
    # 10 prompt tokens and 20 min tokens: 10 + 10 ms, then 19 decode steps of 11 ms.
    assert COST.least_service_seconds(s.least_remaining_work(requests["min_tokens"])) == pytest.approx(0.229)
    # max_model_len ends it whatever it asks: 32 - 10 tokens of room.
    short = create_scheduler(policy="fcfs", max_model_len=32)
    r = _req("r", _tokens(10, 1), deadline=None, max_tokens=50, ignore_eos=True)
    short.add_request(r)
    assert short.least_remaining_work(r) == RemainingWork(10, 10, 0, 22)


def test_a_request_preempted_with_its_outputs_to_recompute_is_shed_at_the_next_step(tmp_path):
    # No prefix cache: a recompute victim computes its prompt and outputs again. r may stop at
    # any token (no ignore_eos), so its bound is its prefill and one token: at arrival 10 + 8 ms.
    s = create_scheduler(policy=_policy(tmp_path), max_num_batched_tokens=64, max_num_seqs=1, num_blocks=64,
                         enable_prefix_caching=False)
    runner = PagedFakeRunner(s.block_size)
    # 18 ms of prefill, then 39 decodes of 11 ms: 40 outputs at 447 ms. Then h, more important,
    # takes its slot: its 40-token prefill ends at 497 ms. r's bound is now 10 + 48 ms, x 0.8 =
    # 46.4 ms, and 30 ms are left: shed there, 15 ms before the key of its look at arrival.
    r = _req("r", _tokens(8, 1000), deadline=0.527, priority=1, max_tokens=100, temperature=0.0)
    s.add_request(r)
    now = 0.0
    while r.num_output_tokens < 40:
        _, now = _step(s, runner, now)
    assert now == pytest.approx(0.447)
    h = _req("h", _tokens(40, 5000), deadline=None, arrival=now, max_tokens=3)
    s.add_request(h)
    out, now = _step(s, runner, now)
    assert out.preempted_req_ids == {"r"} and r.status == RequestStatus.PREEMPTED
    out, now = _step(s, runner, now)
    assert "r" in out.finished_req_ids and r.status == RequestStatus.FINISHED_ABORTED
    assert r.finished_time == pytest.approx(0.497) and r.num_output_tokens == 40
    # Put back twice in the step that preempted it (as the victim, then passed over): shed once.
    assert s.policy.get_stats()["deadline_shed"] == {"expired": 0, "unmeetable": 1}
    assert r.status_message.startswith("deadline cannot be met: needs at least 46.4 ms, 30.0 ms left of its 527 ms "
                                       "deadline (estimated: 0.8 x the step cost model's 58.0 ms for its 48 tokens")
    while s.has_unfinished_requests():
        _, now = _step(s, runner, now)
    assert h.status == RequestStatus.FINISHED_LENGTH
    assert_no_leaks(s)


@pytest.mark.parametrize("mode", ["drop_unmeetable", "drop_unmeetable_corrected", "drop_expired"])
def test_the_policy_keeps_nothing_of_requests_with_deadlines_that_finished(tmp_path, mode):
    # Each request's entry goes once its key passes: state grows with the live ones, not with
    # every request ever served. Corrected, the first 8 steps judge nobody (the arrivals wait,
    # keyed by their deadlines): what they left goes too.
    policy = (_policy(tmp_path) if mode == "drop_unmeetable"
              else _policy(tmp_path, step_time_correction=True) if mode == "drop_unmeetable_corrected"
              else SLAPolicy(SLAConfig(drop_expired=True)))
    s = create_scheduler(policy=policy, max_num_batched_tokens=64, num_blocks=64)
    runner = PagedFakeRunner(s.block_size)
    now = 0.0
    for i in range(300):
        s.add_request(_req(f"q{i}", _tokens(8, 7 * i % 900 + 1), deadline=2.0, arrival=now, max_tokens=2,
                           ignore_eos=True))
        while s.has_unfinished_requests():
            _, now = _step(s, runner, now)
        now += 1.0  # one request a second: every earlier one's deadline has passed
    assert len(policy._deadline_entries) <= 3 and len(policy._deadlines) <= 3 and not policy._unlooked
    assert_no_leaks(s)


def test_nothing_is_judged_before_8_steps_were_measured_when_the_profile_is_corrected(tmp_path):
    # With the correction on, the profile may be of another machine: LOW_RATIO_MIN_STEPS (8)
    # measured steps come before any verdict. Here steps take 10x the profile's time.
    slow = _scaled(10.0)
    s = create_scheduler(policy=_policy(tmp_path, step_time_correction=True), max_num_batched_tokens=64)
    runner = PagedFakeRunner(s.block_size)
    # Alone by the profile: 18 + 4 x 11 ms; 0.8 x 62 = 49.6 ms > 45 ms, but not judged yet: it is
    # shed only once its deadline has passed, at the next step (the first, two prefills, took 260 ms).
    a = _req("a", _tokens(8, 1000), deadline=0.045, max_tokens=5, ignore_eos=True)
    keep = _req("keep", _tokens(8, 3000), deadline=None, max_tokens=60, ignore_eos=True)  # steps to measure
    for r in (a, keep):
        s.add_request(r)
    out, now = _step(s, runner, 0.0, slow)
    assert out.num_scheduled_tokens == {"a": 8, "keep": 8} and now == pytest.approx(0.26)
    _, now = _step(s, runner, now, slow)
    assert a.status_message.startswith("deadline exceeded: the request's deadline of 45 ms passed 215 ms ago")
    for _ in range(LOW_RATIO_MIN_STEPS - 3):  # 7 steps measured
        _, now = _step(s, runner, now, slow)
    assert s.policy.timing.low_ratio is None
    # b arrives with one step to go, and is not judged: its prefill step takes 190 ms; then with
    # 4 tokens to go, alone 4 x 11 ms, 0.8 x 6.13 x 44 = 216 ms > the 190 ms left: shed at the
    # first step judged.
    b = _req("b", _tokens(8, 2000), deadline=0.38, arrival=now, max_tokens=5, ignore_eos=True)
    s.add_request(b)
    out, now = _step(s, runner, now, slow)
    assert out.num_scheduled_tokens["b"] == 8 and not b.is_finished
    # The running ratio moved from 1 towards 10 by a tenth of the gap a step, 8 steps: the lower
    # of it and the steps' own 10.
    ratio = 10 - 9 * (1 - CORRECTION_GAIN) ** LOW_RATIO_MIN_STEPS
    assert s.policy.timing.low_ratio == pytest.approx(ratio) and ratio == pytest.approx(6.126, abs=0.001)
    out = s.schedule(now=now)
    assert "b" in out.finished_req_ids and b.finished_time == now
    assert b.status_message.startswith(f"deadline cannot be met: needs at least {0.8 * ratio * 44:.1f} ms, "
                                       f"{(0.38 - (now - b.arrival_time)) * 1000:.1f} ms left")
    now += slow.predict(step_composition(out, s.requests, s.cache_config.kv_block_bytes))
    s.update_from_output(out, runner.execute(out), now=now)
    assert s.policy.get_stats()["deadline_shed"] == {"expired": 1, "unmeetable": 1}
    while s.has_unfinished_requests():
        _, now = _step(s, runner, now, slow)
    assert_no_leaks(s)


def test_a_machine_faster_than_its_profile_is_judged_by_its_fastest_recent_steps(tmp_path):
    # Steps take a tenth of the profile's time. After the 8 steps before a verdict the running
    # ratio is still 0.1 + 0.9 x 0.9^8 = 0.487; the steps' own 0.1 is the one the bound takes.
    fast = _scaled(0.1)
    s = create_scheduler(policy=_policy(tmp_path, step_time_correction=True), max_num_batched_tokens=128,
                         num_blocks=128)
    runner = PagedFakeRunner(s.block_size)
    s.add_request(_req("first", _tokens(8, 1000), deadline=None, max_tokens=LOW_RATIO_MIN_STEPS, ignore_eos=True))
    now = 0.0
    while s.has_unfinished_requests():
        _, now = _step(s, runner, now, fast)
    assert s.policy.timing.ratio == pytest.approx(0.1 + 0.9 * 0.9 ** 8)
    assert s.policy.timing.low_ratio == pytest.approx(0.1)
    # 127 ms by the profile: 0.8 x 0.487 x 127 = 49.5 ms would not fit in 45 ms; 0.8 x 0.1 x 127
    # does, and on this machine it takes 12.7 ms.
    c = _req("c", _tokens(40, 2000), deadline=0.045, arrival=now, max_tokens=8, ignore_eos=True, temperature=0.0)
    s.add_request(c)
    while s.has_unfinished_requests():
        _, now = _step(s, runner, now, fast)
    assert c.status == RequestStatus.FINISHED_LENGTH and c.finished_time - c.arrival_time == pytest.approx(0.0127)
    assert_no_leaks(s)


def test_slow_first_steps_do_not_get_a_request_that_can_finish_shed(tmp_path):
    # A machine 10x faster than its profile, whose first 3 steps are a warm-up 12x slower than
    # the rest (1.2x the profile). Judged by them (the running ratio 1.054 after them), a request
    # of 127 ms by the profile would need 0.8 x 1.054 x 127 = 107 ms; it takes 17.6 ms here (in
    # steps with two other requests).
    warm, fast = _scaled(1.2), _scaled(0.1)
    s = create_scheduler(policy=_policy(tmp_path, step_time_correction=True), max_num_batched_tokens=128,
                         num_blocks=128)
    runner = PagedFakeRunner(s.block_size)
    params = dict(max_tokens=8, ignore_eos=True, temperature=0.0)
    s.add_request(_req("keep", _tokens(8, 1000), deadline=None, max_tokens=60, ignore_eos=True))
    now = 0.0
    for _ in range(3):
        _, now = _step(s, runner, now, warm)
    c = _req("c", _tokens(40, 2000), deadline=0.05, arrival=now, **params)
    # One that cannot make it (alone it takes 12.7 ms) is shed once its deadline has passed.
    h = _req("h", _tokens(40, 3000), deadline=0.01, arrival=now, **params)
    for r in (c, h):
        s.add_request(r)
    while not c.is_finished:
        _, now = _step(s, runner, now, fast)
    assert c.status == RequestStatus.FINISHED_LENGTH and c.finished_time - c.arrival_time == pytest.approx(0.0176)
    assert c.output_token_ids == reference_stream(c.prompt_token_ids, 8)
    assert h.status_message.startswith("deadline exceeded: the request's deadline of 10 ms passed")
    # Once 8 steps are measured the fast ones are trusted (the first verdict on c came while it
    # ran, 3 decodes to go: 0.8 x 0.1 x 33 ms fit easily): one that cannot make it
    # (alone 12.7 ms, 10 ms left) is shed at once: 0.8 x 0.1 x 127 = 10.16 ms > 10 ms.
    while s.policy.timing.low_ratio is None:
        _, now = _step(s, runner, now, fast)
    assert s.policy.timing.low_ratio == pytest.approx(0.1)
    d = _req("d", _tokens(40, 4000), deadline=0.01, arrival=now, **params)
    s.add_request(d)
    out, now = _step(s, runner, now, fast)
    assert "d" in out.finished_req_ids and d.finished_time == d.arrival_time
    assert d.status_message.startswith("deadline cannot be met: needs at least 10.2 ms, 10.0 ms left")
    assert s.policy.get_stats()["deadline_shed"] == {"expired": 1, "unmeetable": 1}
    while s.has_unfinished_requests():
        _, now = _step(s, runner, now, fast)
    assert_no_leaks(s)


@pytest.mark.parametrize("kwargs, message", [
    (dict(scheduling_policy="fcfs", sla_drop_unmeetable=True), "sla_drop_unmeetable only applies to scheduling_policy 'sla'"),
    (dict(scheduling_policy="sla", sla_drop_unmeetable=True, sla_step_time_correction=False),
     "sla drop_unmeetable needs step times of this machine: give cost_profile"),
    (dict(scheduling_policy="sla", sla_drop_unmeetable=True, sla_unmeetable_margin=1.0),
     r"sla unmeetable_margin must be in \(0, 1\)"),
    (dict(scheduling_policy="sla", sla_unmeetable_margin=0.5), r"sla unmeetable_margin \(0.5\) applies only with drop_unmeetable"),
    # The default's value too: given, it is a margin without the flag.
    (dict(scheduling_policy="sla", sla_unmeetable_margin=0.8), r"sla unmeetable_margin \(0.8\) applies only with drop_unmeetable"),
    (dict(scheduling_policy="fcfs", sla_unmeetable_margin=0.8), "sla_unmeetable_margin only applies to scheduling_policy 'sla'"),
    # A profile that cannot be read is refused with the arguments, not when an engine builds its policy.
    (dict(scheduling_policy="sla", sla_protect_slos=True, sla_cost_profile="/nonexistent/profile.json"),
     r"cost profile /nonexistent/profile.json does not exist"),
])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)


def _least_samples(r: Request) -> int:
    """The fewest tokens a request could still sample before it finishes (the test's own account)."""
    p = r.sampling_params
    if p.ignore_eos and not p.stop_token_ids and not p.stop:
        return p.max_tokens - r.num_output_tokens
    return max(1, p.min_tokens - r.num_output_tokens)


def _alone(tokens: list[int], computed: int, samples: int, cost: StepCostModel, block_size: int) -> float:
    """How long a request in this state takes served alone by a fresh engine: its first
    `computed` tokens in the prefix cache (put there by a request run before it), then it runs
    with nothing else, to exactly `samples` more tokens."""
    s = create_scheduler(policy="fcfs", max_num_batched_tokens=4096, num_blocks=512, block_size=block_size)
    runner = PagedFakeRunner(block_size)
    if computed >= block_size:
        # Its full blocks are published: the probe hits the whole blocks of `computed` (up to
        # block_size - 1 tokens fewer: alone is then a little slower than from the real state).
        s.add_request(_req("warm", tokens[:computed], deadline=None, max_tokens=1))
        now = 0.0
        while s.has_unfinished_requests():
            _, now = _step(s, runner, now, cost)
    probe = _req("probe", tokens, deadline=None, max_tokens=samples, min_tokens=samples, ignore_eos=True)
    s.add_request(probe)
    start = now = 100.0
    while s.has_unfinished_requests():
        _, now = _step(s, runner, now, cost)
    assert probe.num_output_tokens == samples
    return now - start


@pytest.mark.parametrize("seed", range(12))
def test_random_overload_sheds_only_requests_that_could_not_finish_in_time_even_alone(tmp_path, seed):
    rng = random.Random(seed)
    cost = StepCostModel({**dict.fromkeys(FEATURES, 0.0), "step": rng.uniform(0.005, 0.02),
                          "tokens": rng.uniform(0.0002, 0.002), "prefill_attention": rng.uniform(0, 1e-6),
                          "decode_context": rng.uniform(0, 1e-5), "seqs": rng.uniform(0, 0.001),
                          "small_step": rng.choice([0.0, 0.005])}, swap_bytes_per_second=1e9,
                         small_step_max_tokens=8)
    mode = rng.choice(["recompute", "swap"])
    cfg = SLAConfig(drop_unmeetable=True, drop_expired=rng.random() < 0.5, cost_profile=_profile(tmp_path, cost),
                    step_time_correction=rng.random() < 0.5, unmeetable_margin=rng.choice([0.5, 0.8, 0.95]))
    s = create_scheduler(policy=SLAPolicy(cfg), max_num_batched_tokens=rng.choice([32, 64]), max_num_seqs=6,
                         num_blocks=rng.choice([24, 48]), preemption_mode=mode,
                         num_host_blocks=64 if mode == "swap" else 0, kv_block_bytes=1024)
    runner = PagedFakeRunner(s.block_size)
    prefixes = [_tokens(rng.randint(4, 24), 10_000 * (i + 1)) for i in range(3)]
    arrivals, now, t = [], 0.0, 0.0
    for i in range(40):
        t += rng.expovariate(30.0)
        prompt = rng.choice(prefixes) + _tokens(rng.randint(1, 12), 100_000 + 100 * i)
        params = rng.choice([dict(max_tokens=rng.randint(1, 12), ignore_eos=True),
                             dict(max_tokens=12, min_tokens=rng.randint(0, 6)),
                             dict(max_tokens=12, ignore_eos=True, stop_token_ids=[5])])
        deadline = rng.choice([None, rng.uniform(0.02, 0.4)])
        arrivals.append(_req(f"r{i}", prompt, deadline, arrival=t, priority=rng.randint(0, 2), **params))
    shed: list[tuple[Request, float, list[int], int, int]] = []  # (request, when, tokens, computed, samples)
    pending = list(arrivals)
    for _ in range(5000):
        if not (pending or s.has_unfinished_requests()):
            break
        if not s.has_unfinished_requests():
            now = max(now, pending[0].arrival_time)
        while pending and pending[0].arrival_time <= now:
            s.add_request(pending.pop(0))
        # What each request with a deadline has before this step, for those the step sheds.
        before = {r.request_id: (r, list(r.all_token_ids), s.least_remaining_work(r).num_computed_tokens,
                                 _least_samples(r)) for r in s.requests.values() if r.deadline is not None}
        out, now = _step(s, runner, now, cost)
        for rid in out.finished_req_ids:
            if rid in before and (before[rid][0].status_message or "").startswith("deadline cannot be met"):
                r, tokens, computed, samples = before[rid]
                shed.append((r, r.finished_time, tokens, computed, samples))
    assert not pending
    assert_no_leaks(s)
    for r, when, tokens, computed, samples in shed:
        assert r.status == RequestStatus.FINISHED_ABORTED and when < r.deadline
        assert when + _alone(tokens, computed, samples, cost, s.block_size) > r.deadline, r.request_id
    for r in arrivals:
        assert r.is_finished
        if r.status_message is None:  # served to its end
            assert r.output_token_ids == reference_stream(r.prompt_token_ids, r.num_output_tokens)


@pytest.mark.parametrize("mode", ["drop_unmeetable", "drop_expired", "drop_unmeetable_corrected"])
def test_a_reused_id_is_judged_by_its_own_deadline(tmp_path, mode):
    policy = (_policy(tmp_path) if mode == "drop_unmeetable"
              else _policy(tmp_path, step_time_correction=True) if mode == "drop_unmeetable_corrected"
              else SLAPolicy(SLAConfig(drop_expired=True)))
    s = create_scheduler(policy=policy, max_num_batched_tokens=64, max_num_seqs=1, num_blocks=64)
    runner = PagedFakeRunner(s.block_size)
    now = 0.0
    # 1. "x" served to the end with a deadline far off.
    x1 = _req("x", _tokens(8, 1000), deadline=100.0, arrival=now, max_tokens=2, ignore_eos=True)
    s.add_request(x1)
    while s.has_unfinished_requests():
        _, now = _step(s, runner, now)
    assert x1.status == RequestStatus.FINISHED_LENGTH
    # 2. "x" again, waiting behind a long runner "b" (one slot), aborted while waiting.
    b = _req("b", _tokens(8, 3000), deadline=None, arrival=now, max_tokens=200, ignore_eos=True, priority=0)
    s.add_request(b)
    _, now = _step(s, runner, now)
    x2 = _req("x", _tokens(8, 5000), deadline=0.5, arrival=now, max_tokens=2, ignore_eos=True, priority=3)
    s.add_request(x2)
    _, now = _step(s, runner, now)
    assert x2.status == RequestStatus.WAITING
    s.abort_requests(["x"], now=now)
    # 3. "x" a third time, waiting behind b with a short deadline: shed when it passes (at the latest).
    x3 = _req("x", _tokens(8, 7000), deadline=0.3, arrival=now, max_tokens=2, ignore_eos=True, priority=3)
    s.add_request(x3)
    start = now
    while x3.status == RequestStatus.WAITING and now < start + 5.0:
        _, now = _step(s, runner, now)
    assert x3.status == RequestStatus.FINISHED_ABORTED, x3.status
    assert now <= start + 0.3 + 0.03  # within a step of its deadline
    # 4. "x" a fourth time with room to finish: served, not shed.
    s.abort_requests(["b"], now=now)
    x4 = _req("x", _tokens(8, 9000), deadline=5.0, arrival=now, max_tokens=2, ignore_eos=True)
    s.add_request(x4)
    while s.has_unfinished_requests():
        _, now = _step(s, runner, now)
    assert x4.status == RequestStatus.FINISHED_LENGTH
    for _ in range(3):
        _, now = _step(s, runner, now + 10.0)
    assert not policy._deadline_entries and not policy._unlooked
    assert_no_leaks(s)

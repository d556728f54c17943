"""The measured/predicted step-time correction (core/step_timing.py) that `slo` batch control
and sla's SLO guard share: what a step's period is, its bounds, and how the scheduler hands the
policy the step's observation (built once, only if someone reads it)."""

from __future__ import annotations

import pytest

from tests.core.helpers import PagedFakeRunner, assert_no_leaks, create_scheduler, make_request
from tokenweir.config import CacheConfig, SchedulerConfig
from tokenweir.core import scheduler as scheduler_module
from tokenweir.core.batch_control import StepObservation, StepLimits
from tokenweir.core.batch_slo import SLOBatchConfig, SLOBatchController
from tokenweir.core.cost_model import FEATURES, StepComposition, StepCostModel
from tokenweir.core.policies import FCFSPolicy, SLAConfig, SLAPolicy
from tokenweir.core.scheduler import Scheduler
from tokenweir.core.step_timing import CORRECTION_GAIN, MAX_STEP_FACTOR, StepTimeCorrection

# 10 ms per step plus 1 ms per token.
MODEL = StepCostModel({**{name: 0.0 for name in FEATURES}, "step": 0.010, "tokens": 0.001}, 1e9)
DECODE = StepComposition(num_decode_seqs=10, decode_context_tokens=1000, num_sampled=10)  # 20 ms predicted


def _obs(now: float, itl_rows: int = 10, comp: StepComposition = DECODE) -> StepObservation:
    return StepObservation(now, comp, itl_rows, (), 10, 0, 1000, 0.1)


def _steady(timing: StepTimeCorrection, now: float, period: float, n: int) -> float:
    """n decode steps back to back, each `period` long."""
    for _ in range(n):
        timing.begin_step(now)
        now += period
        timing.observe(_obs(now))
    return now


def test_a_decode_step_is_timed_from_the_previous_results_and_a_first_step_from_its_start():
    timing = StepTimeCorrection(MODEL)
    timing.begin_step(1.0)
    assert timing.observe(_obs(1.05)) is None  # the first step: no previous results
    assert timing.ratio == pytest.approx(1 + CORRECTION_GAIN * (0.05 / 0.02 - 1))
    timing.begin_step(1.06)  # 10 ms between the results and the next schedule: the decode rows waited them too
    assert timing.observe(_obs(1.10)) == pytest.approx(0.05)
    # After idle time, a step of first tokens only is timed from its own start.
    timing.begin_step(5.0)
    assert timing.observe(_obs(5.02, itl_rows=0)) is None
    # An empty step predicts nothing: no correction from it.
    before = timing.ratio
    timing.begin_step(6.0)
    timing.observe(_obs(6.0, itl_rows=0, comp=StepComposition()))
    assert timing.ratio == before


def test_the_ratio_converges_to_the_machine_and_one_outlier_moves_it_within_a_bound():
    timing = StepTimeCorrection(MODEL)
    now = _steady(timing, 0.0, 0.1, 100)  # the machine is 5x slower than the model
    assert timing.ratio == pytest.approx(5.0, rel=1e-3)
    assert timing.predict(DECODE) == pytest.approx(0.1, rel=1e-3)
    # One step 3x the usual moves the ratio by a tenth of its error; one 1,000x (a stall)
    # moves it no more than one MAX_STEP_FACTOR x, and the steps after bring it back.
    moved = {}
    for outlier in (3, MAX_STEP_FACTOR, 1000):
        t = StepTimeCorrection(MODEL)
        end = _steady(t, 0.0, 0.1, 100)
        t.begin_step(end)
        t.observe(_obs(end + 0.1 * outlier))
        moved[outlier] = t.ratio / 5.0
        _steady(t, end + 0.1 * outlier, 0.1, 30)
        assert t.ratio == pytest.approx(5.0, rel=0.05)
    assert moved[3] == pytest.approx(1 + CORRECTION_GAIN * 2, rel=1e-3)
    assert moved[1000] == pytest.approx(moved[MAX_STEP_FACTOR]) == pytest.approx(
        1 + CORRECTION_GAIN * (MAX_STEP_FACTOR - 1), rel=1e-3)
    # ... and a step that seems to take no time at all moves it down by at most as much.
    timing.begin_step(now)
    timing.observe(_obs(now + 1e-9))
    assert timing.ratio == pytest.approx(5.0 * (1 - CORRECTION_GAIN * (1 - 1 / MAX_STEP_FACTOR)), rel=1e-3)


class _Observing(FCFSPolicy):
    def __init__(self) -> None:
        super().__init__()
        self.observations: list[StepObservation] = []

    def on_step_observed(self, observation: StepObservation) -> None:
        self.observations.append(observation)


class _Controller(SLOBatchController):
    def __init__(self) -> None:
        super().__init__(SLOBatchConfig(target_tpot_ms=1e6, initial_num_batched_tokens=64, initial_num_seqs=4),
                         StepLimits(64, 4), MODEL)
        self.observations: list[StepObservation] = []

    def on_step(self, observation: StepObservation) -> None:
        super().on_step(observation)
        self.observations.append(observation)


def _count_observations(monkeypatch) -> list[int]:
    built = [0]
    original = scheduler_module.observe_step

    def counting(*args, **kwargs):
        built[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(scheduler_module, "observe_step", counting)
    return built


def test_the_scheduler_builds_one_observation_per_step_for_policy_and_controller_and_none_unasked(monkeypatch):
    built = _count_observations(monkeypatch)
    policy, controller = _Observing(), _Controller()
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4), CacheConfig(block_size=4, num_blocks=64),
                  policy=policy, batch_controller=controller)
    runner = PagedFakeRunner(s.block_size)
    s.add_request(make_request("a", 8, max_tokens=3))
    for now in (0.5, 0.6, 0.7):
        out = s.schedule(now - 0.05)
        s.update_from_output(out, runner.execute(out), now)
    assert built[0] == 3
    assert [o.now for o in policy.observations] == [0.5, 0.6, 0.7]  # when the results came back
    assert all(p is c for p, c in zip(policy.observations, controller.observations))  # the same one
    out = s.schedule(0.8)
    s.fail_step(out, 0.9)
    assert built[0] == 3 and len(policy.observations) == 3  # a failed step is not observed

    plain = create_scheduler()  # fcfs, static limits: nobody reads it
    plain.add_request(make_request("b", 8, max_tokens=3))
    runner = PagedFakeRunner(plain.block_size)
    out = plain.schedule(0.0)
    plain.update_from_output(out, runner.execute(out), 0.1)
    assert built[0] == 3


def test_sla_feeds_its_guard_the_measured_steps_unless_told_not_to():
    for correction in (True, False):
        policy = SLAPolicy(SLAConfig(step_time_correction=correction))
        s = create_scheduler(policy=policy, max_num_batched_tokens=64, num_blocks=64)
        runner = PagedFakeRunner(s.block_size)
        s.add_request(make_request("a", 8, max_tokens=20))
        now = 0.0
        for _ in range(20):
            out = s.schedule(now)
            now += 0.001  # far faster than the shipped CPU profile
            s.update_from_output(out, runner.execute(out), now)
        ratio = s.get_stats().policy["slo_guard_step_time_ratio"]
        assert (ratio < 0.5) if correction else (ratio == 1.0)


def test_a_failed_step_is_not_charged_to_the_ratio_of_the_retry():
    # Every step exactly as predicted; five steps fail (scheduled, no results) and are retried.
    # The retry's rows waited for both (its ITL), but what the retry cost is its own time.
    from tokenweir.core.cost_model import load_cost_model
    model = load_cost_model(None)
    comp = StepComposition(num_decode_seqs=8, decode_context_tokens=800, num_sampled=8)
    seconds = model.predict(comp)
    timing, now = StepTimeCorrection(model), 0.0

    def step() -> float:
        nonlocal now
        timing.begin_step(now)
        now += seconds
        return timing.observe(StepObservation(now, comp, 8, [], 8, 0, 800, 0.1))

    for _ in range(50):
        step()
    for _ in range(5):
        timing.begin_step(now)  # fails: no observation
        now += seconds
        assert step() == pytest.approx(2 * seconds)  # the ITL its rows saw
    assert timing.ratio == pytest.approx(1.0)


def test_steps_with_swap_copies_are_measured_against_a_prediction_with_them():
    # A machine that takes exactly what the cost model predicts for each step, swap copies
    # included (as the simulator's virtual clock does): the ratio must stay 1. Measured against
    # a prediction without the copies (10 ms a block here), every swap step would look slower
    # than the model and scale up every prediction after it.
    from tokenweir.core.cost_model import step_composition
    kv_block_bytes = 10_000_000  # 10 ms a block at the model's 1 GB/s
    controller = _Controller()
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4),
                  CacheConfig(block_size=4, num_blocks=7, preemption_mode="swap", num_host_blocks=16,
                              kv_block_bytes=kv_block_bytes),
                  batch_controller=controller)
    runner = PagedFakeRunner(s.block_size)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 7, max_tokens=8))
    now, num_copied = 0.0, 0
    while s.has_unfinished_requests():
        out = s.schedule(now)
        copies = len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
        num_copied += copies
        comp = step_composition(out, s.requests, kv_block_bytes)
        assert comp.swap_bytes == copies * kv_block_bytes
        now += MODEL.predict(comp)
        s.update_from_output(out, runner.execute(out), now)
        if copies:
            assert controller.observations[-1].composition == comp
        assert controller.timing.ratio == pytest.approx(1.0)
    assert num_copied >= 4  # swapped out and back in: the case was exercised
    assert_no_leaks(s)

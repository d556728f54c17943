"""sla's SLO guard corrected by measured step times, in the simulator (whose cost model, the
shipped profile, is the truth): guards given that profile 5x too slow and 5x too fast see the
same steps as the guard given the true one and, once the correction has converged, make the
same admit/refuse decisions; without it they do not."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from tests.core.helpers import assert_no_leaks
from tokenweir.config import EngineArgs
from tokenweir.core.batch_control import StepObservation
from tokenweir.core.cost_model import StepCostModel, StepTally, load_cost_model
from tokenweir.core.policies import SLAConfig, SLAPolicy
from tokenweir.core.policies.sla_guard import SLOGuard
from tokenweir.core.queues import RequestQueue
from tokenweir.core.scheduler import Scheduler
from tokenweir.request import Request, SchedulingHints
from tokenweir.sim.simulator import SimRequest, Simulator, scheduler_configs

TRUTH = load_cost_model(None)
WRONG = (5.0, 0.2)  # the shadow guards' profiles: every time x5 (too slow), x0.2 (too fast)
# Steps after which the corrected guards must agree: their ratios approach the true guard's
# scaled by 1/x at 10% a step (core/step_timing.py), 0.9^150 ~ 1e-7 of the initial error.
CONVERGED_AFTER = 150


def scaled(model: StepCostModel, factor: float) -> StepCostModel:
    return StepCostModel({k: v * factor for k, v in model.coefficients.items()},
                         model.swap_bytes_per_second / factor, dict(model.metadata),
                         model.small_step_max_tokens, model.decode_knee)


class ShadowedSLA(SLAPolicy):
    """sla deciding by its own guard (the true profile, corrected), with shadow guards that see
    every step it sees and are asked every question it is asked; the first two shadows are fed
    the measured steps, the last two (the same wrong profiles) are not."""

    def __init__(self) -> None:
        super().__init__(SLAConfig())
        n = self.config.num_priority_classes
        self.shadows = [SLOGuard(scaled(TRUTH, f), n) for f in (*WRONG, *WRONG)]
        self.num_observed = 0
        self.asked: list[tuple[int, bool, list[bool]]] = []  # (steps observed, verdict, shadows' verdicts)

    def begin_step(self, now: float, waiting: RequestQueue, running: Sequence[Request]) -> None:
        super().begin_step(now, waiting, running)
        for guard in self.shadows:
            guard.begin_step(now, running)

    def on_step_observed(self, observation: StepObservation) -> None:
        super().on_step_observed(observation)
        for guard in self.shadows[:len(WRONG)]:
            guard.observe(observation)
        self.num_observed += 1

    def may_admit(self, request: Request, num_new_tokens: int, num_computed_tokens: int,
                  step: StepTally, now: float) -> bool:
        verdict = super().may_admit(request, num_new_tokens, num_computed_tokens, step, now)
        if not self._is_aged(request, now):  # else no guard is asked
            self.asked.append((self.num_observed, verdict,
                               [g.admits(request, num_new_tokens, num_computed_tokens, step)
                                for g in self.shadows]))
        return verdict


def _requests(n: int = 400, rate: float = 4.0, seed: int = 1) -> list[SimRequest]:
    """The tight overload shape of docs/benchmarks/sla.md: 30% interactive (TTFT 1 s, TPOT
    150 ms), 70% batch, prompts 128-384 tokens, 32-96 outputs, about 1.5x capacity."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, n))
    out = []
    for i, t in enumerate(arrivals):
        interactive = rng.random() < 0.3
        hints = (SchedulingHints(priority=0, ttft_slo=1.0, tpot_slo=0.15) if interactive
                 else SchedulingHints(priority=1, ttft_slo=60.0, tpot_slo=1.0))
        prompt_len = int(rng.integers(128, 385))
        out.append(SimRequest(f"r{i}", [(i * 131 + j) % 30000 + 1000 for j in range(prompt_len)],
                              int(rng.integers(32, 97)), float(t), hints))
    return out


def test_guards_given_a_profile_5x_off_decide_as_the_true_one_once_corrected():
    meta = TRUTH.metadata
    args = EngineArgs(scheduling_policy="sla", max_num_seqs=32)
    cache_cfg, sched_cfg = scheduler_configs(args, int(meta["max_model_len"]), int(meta["kv_cache_bytes"]),
                                             int(meta["kv_bytes_per_block"]) // int(meta["block_size"]))
    policy = ShadowedSLA()
    sim = Simulator(Scheduler(sched_cfg, cache_cfg, policy=policy, cost_model=TRUTH), TRUTH,
                    int(meta["kv_bytes_per_block"]))
    sim.run(_requests())
    assert_no_leaks(sim.scheduler)

    late = [(verdict, shadows) for step, verdict, shadows in policy.asked if step >= CONVERGED_AFTER]
    verdicts = [verdict for verdict, _ in late]
    assert len(late) >= 100 and verdicts.count(False) >= 10 and verdicts.count(True) >= 10  # it decided
    corrected = [shadows[:len(WRONG)] for _, shadows in late]
    assert all(s == [v] * len(WRONG) for v, s in zip(verdicts, corrected))
    # Without the correction each wrong profile keeps deciding otherwise (the test can fail).
    for i in range(len(WRONG)):
        assert sum(shadows[len(WRONG) + i] != verdict for verdict, shadows in late) >= 10, WRONG[i]
    # The true profile's ratio stays near 1: the observation's composition is close to exact.
    assert 0.99 < policy.guard.timing.ratio < 1.01
    for guard, factor in zip(policy.shadows, WRONG):
        assert guard.timing.ratio * factor == pytest.approx(policy.guard.timing.ratio)

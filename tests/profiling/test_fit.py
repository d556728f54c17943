"""The cost model fit recovers a known formula, and NNLS is a true non-negative least squares."""

from __future__ import annotations

import numpy as np
import pytest

from tokenweir.core.cost_model import FEATURES, StepCostModel, chunk_composition
from tokenweir.profiling.fit import fit_cost_model, fit_errors, nnls

TRUE = {"step": 0.012, "tokens": 0.0005, "seqs": 0.0001, "decode_context": 2e-6,
        "prefill_attention": 5e-7, "sampled": 0.0003, "small_step": 0.009, "decode_beyond_knee": 0.0}
KNEES = (0, 4, 8, 12, 16, 24, 32)


def synthetic_steps(rng: np.random.Generator, n: int):
    comps = []
    for _ in range(n):
        parts = []
        for _ in range(int(rng.integers(1, 40))):  # decode rows at random contexts
            ctx = int(rng.integers(1, 1500))
            parts.append(chunk_composition(1, ctx, ctx + 1, 10))
        if rng.random() < 0.5:  # and maybe a prefill chunk
            n_tok, done = int(rng.integers(1, 600)), int(rng.integers(0, 1500))
            parts.append(chunk_composition(n_tok, done, done + n_tok + int(rng.integers(0, 2)), done + n_tok))
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        comps.append(total)
    return comps


def test_fit_recovers_known_coefficients_from_noisy_times() -> None:
    rng = np.random.default_rng(0)
    true = StepCostModel(TRUE, 1e9, small_step_max_tokens=4)
    comps = synthetic_steps(rng, 400)
    # Add small steps so the small-step term is identifiable.
    comps += [chunk_composition(1, c, c + 1, 5) for c in rng.integers(1, 1000, size=40)]
    times = [true.predict(c) * (1 + rng.normal(0, 0.01)) for c in comps]
    fitted = fit_cost_model(comps, times, 1e9, small_step_max_tokens=4)
    for name in ("step", "tokens", "decode_context", "prefill_attention", "small_step"):
        assert fitted.coefficients[name] == pytest.approx(TRUE[name], rel=0.1), name
    errors = {e.region: e for e in fit_errors(fitted, comps, times, ["r"] * len(comps))}
    assert errors["all"].mape < 0.02 and errors["all"].num_samples == len(comps)


def test_fit_finds_the_decode_knee_and_the_extra_per_row_beyond_it() -> None:
    rng = np.random.default_rng(3)
    true = StepCostModel({**TRUE, "small_step": 0.0, "decode_beyond_knee": 0.0008}, 1e9, decode_knee=12)
    comps = synthetic_steps(rng, 500)
    times = [true.predict(c) * (1 + rng.normal(0, 0.01)) for c in comps]
    fitted = fit_cost_model(comps, times, 1e9, decode_knees=KNEES)
    assert fitted.decode_knee == 12
    for name in ("step", "tokens", "decode_context", "prefill_attention", "decode_beyond_knee"):
        assert fitted.coefficients[name] == pytest.approx(true.coefficients[name], rel=0.1), name
    # Without a knee among the candidates the straight line is worse: the knee is what fits.
    straight = fit_cost_model(comps, times, 1e9)
    assert straight.decode_knee == 0 and straight.coefficients["decode_beyond_knee"] == 0.0

    def mape(model: StepCostModel) -> float:
        return next(e.mape for e in fit_errors(model, comps, times, ["r"] * len(comps)) if e.region == "all")
    assert mape(fitted) < 0.02 < mape(straight)
    # A formula without a knee is fitted without one, whatever the candidates.
    plain = StepCostModel({**TRUE, "small_step": 0.0}, 1e9)
    assert fit_cost_model(comps, [plain.predict(c) for c in comps], 1e9, decode_knees=KNEES).coefficients[
        "decode_beyond_knee"] == pytest.approx(0.0, abs=1e-9)


def test_fit_of_exact_times_is_exact() -> None:
    rng = np.random.default_rng(1)
    true = StepCostModel(TRUE, 1e9, small_step_max_tokens=4)
    comps = synthetic_steps(rng, 300) + [chunk_composition(1, c, c + 1, 5) for c in range(1, 200, 7)]
    fitted = fit_cost_model(comps, [true.predict(c) for c in comps], 1e9, small_step_max_tokens=4)
    for c in comps[:50]:
        assert fitted.predict(c) == pytest.approx(true.predict(c), rel=1e-6)


def test_nnls_matches_brute_force_over_active_sets() -> None:
    rng = np.random.default_rng(2)
    for _ in range(20):
        a = rng.normal(size=(30, 5))
        b = rng.normal(size=30)
        x = nnls(a, b)
        assert (x >= 0).all()
        best = np.inf
        for mask in range(1, 32):  # every subset of free coefficients, keep feasible optima
            cols = [j for j in range(5) if mask >> j & 1]
            z = np.linalg.lstsq(a[:, cols], b, rcond=None)[0]
            if (z >= 0).all():
                best = min(best, np.linalg.norm(a[:, cols] @ z - b))
        best = min(best, np.linalg.norm(b))
        assert np.linalg.norm(a @ x - b) == pytest.approx(best, rel=1e-9)


def test_fit_rejects_bad_samples() -> None:
    comp = chunk_composition(4, 0, 4, 4)
    with pytest.raises(ValueError, match="one time per composition"):
        fit_cost_model([comp], [], 1e9)
    with pytest.raises(ValueError, match="> 0"):
        fit_cost_model([comp], [0.0], 1e9)
    assert set(fit_cost_model([comp] * 3, [0.1] * 3, 1e9).coefficients) == set(FEATURES)

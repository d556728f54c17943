"""Fitting the step cost model to timed steps, and how well it fits.

The fit minimises relative error (each sample weighted by 1/time), so a 20 ms decode step
counts as much as a 2 s prefill step: the simulator's TPOT depends on the small steps being
right, its TTFT on the large ones. Each kind of step weighs the same in total (samples are
grouped by the binary magnitude of their decode rows and prefill tokens, and a group of n
samples gives each 1/n): a load records many more small decode steps than large mixed ones,
and the fit must not trade the rare shapes for the common one. Coefficients are kept
non-negative (no feature makes a step faster), which also keeps nearly collinear features
(rows and sampled rows) from cancelling. The decode knee is not a coefficient: each candidate
is fitted, and the one with the least (weighted) error is kept.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenweir.core.cost_model import FEATURES, StepComposition, StepCostModel, feature_vector


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int = 200) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0 (Lawson and Hanson's active-set method)."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(max_iter):
        gradient = a.T @ (b - a @ x)
        candidates = ~passive & (gradient > 1e-12 * max(1.0, np.abs(gradient).max()))
        if not candidates.any():
            break
        passive[np.argmax(np.where(candidates, gradient, -np.inf))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            # Step from x towards z until the first passive coefficient reaches zero.
            shrinking = passive & (z <= 0)
            alpha = np.min(x[shrinking] / (x[shrinking] - z[shrinking]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
    return x


@dataclass(frozen=True, slots=True)
class RegionError:
    region: str
    num_samples: int
    mape: float  # mean absolute percentage error, as a fraction
    max_error: float  # largest absolute relative error, as a fraction


def fit_cost_model(compositions: Sequence[StepComposition], seconds: Sequence[float],
                   swap_bytes_per_second: float, metadata: dict | None = None,
                   small_step_max_tokens: int = 0, decode_knees: Sequence[int] = (0,)) -> StepCostModel:
    """The least-squares fit for each candidate decode knee; the one that fits best."""
    if len(compositions) != len(seconds) or not compositions:
        raise ValueError("fitting needs one time per composition, and at least one sample")
    t = np.asarray(seconds, dtype=float)
    if (t <= 0).any():
        raise ValueError("step times must be > 0")
    groups = [(c.num_decode_seqs.bit_length(), c.num_prefill_tokens.bit_length()) for c in compositions]
    sizes = Counter(groups)
    w = np.sqrt([1.0 / sizes[g] for g in groups])  # squared in the least squares: 1/n per sample
    best: tuple[float, int, np.ndarray] | None = None
    for knee in decode_knees:
        x = np.array([feature_vector(c, small_step_max_tokens, knee) for c in compositions]) / t[:, None] * w[:, None]
        # Scale columns to comparable magnitudes (attention pairs run to millions) so the
        # solver's tolerances mean the same thing for every feature.
        scale = np.abs(x).max(axis=0)
        scale[scale == 0] = 1.0
        coef = nnls(x / scale, w)
        residual = float(np.sum((x / scale @ coef - w) ** 2))
        if best is None or residual < best[0]:
            best = (residual, knee, coef / scale)
    _, knee, coef = best
    return StepCostModel(dict(zip(FEATURES, (float(c) for c in coef))), swap_bytes_per_second,
                         dict(metadata or {}), small_step_max_tokens, knee)


def fit_errors(model: StepCostModel, compositions: Sequence[StepComposition],
               seconds: Sequence[float], regions: Sequence[str]) -> list[RegionError]:
    """Relative error per region, and over all samples (region "all")."""
    by_region: dict[str, list[float]] = {}
    for comp, t, region in zip(compositions, seconds, regions):
        err = abs(model.predict(comp) - t) / t
        by_region.setdefault(region, []).append(err)
        by_region.setdefault("all", []).append(err)
    return [RegionError(r, len(e), float(np.mean(e)), float(np.max(e))) for r, e in by_region.items()]


def format_errors(errors: Sequence[RegionError]) -> str:
    lines = [f"{'region':<10} {'samples':>8} {'MAPE':>8} {'max err':>8}"]
    lines += [f"{e.region:<10} {e.num_samples:>8} {e.mape:>8.1%} {e.max_error:>8.1%}" for e in errors]
    return "\n".join(lines)

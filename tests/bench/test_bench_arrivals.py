import math

import numpy as np
import pytest

from tokenweir.bench.arrivals import draw_gaps, make_arrival_times


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 3.0])
def test_last_arrival_is_exactly_n_over_rate(burstiness):
    times = make_arrival_times(37, 4.0, burstiness, np.random.default_rng(0))
    assert len(times) == 37
    assert times[-1] == 37 / 4.0
    assert np.all(np.diff(times) >= 0) and times[0] > 0


def test_infinite_rate_sends_everything_at_once():
    assert np.array_equal(make_arrival_times(5, math.inf, 1.0, np.random.default_rng(0)),
                          np.zeros(5))


def test_infinite_burstiness_is_a_fixed_gap():
    assert np.allclose(make_arrival_times(4, 2.0, math.inf, np.random.default_rng(0)),
                       [0.5, 1.0, 1.5, 2.0])


def test_seed_reproducible():
    def times(seed):
        return make_arrival_times(50, 10.0, 1.0, np.random.default_rng(seed))
    assert np.array_equal(times(7), times(7))
    assert not np.array_equal(times(7), times(8))


@pytest.mark.parametrize("burstiness", [1.0, 4.0, 0.25])
def test_gap_mean_is_one_over_rate_and_cv_follows_burstiness(burstiness):
    # Gamma(k, 1/(rate k)): mean 1/rate whatever k; coefficient of variation 1/sqrt(k),
    # so Poisson (k = 1) has CV 1 and a smoother k = 4 has CV 0.5.
    gaps = draw_gaps(200_000, 5.0, burstiness, np.random.default_rng(1))
    assert gaps.mean() == pytest.approx(0.2, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.03)


@pytest.mark.parametrize("rate, burstiness", [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)])
def test_invalid_parameters(rate, burstiness):
    with pytest.raises(ValueError):
        draw_gaps(3, rate, burstiness, np.random.default_rng(0))


def test_zero_requests():
    assert len(make_arrival_times(0, 2.0, 1.0, np.random.default_rng(0))) == 0


class StubRng:
    """Returns fixed gaps from `gamma` and records the parameters it was asked for."""

    def __init__(self, gaps: list[float]) -> None:
        self.gaps = np.array(gaps)
        self.calls: list[dict] = []

    def gamma(self, shape: float, scale: float, size: int) -> np.ndarray:
        self.calls.append({"shape": shape, "scale": scale, "size": size})
        return self.gaps[:size].copy()


def test_gamma_parameters_give_mean_one_over_rate():
    # rate 5, burstiness 4: shape 4, scale 1 / (5 * 4) = 0.05, mean shape * scale = 0.2 = 1 / 5.
    rng = StubRng([0.1, 0.2, 0.3])
    gaps = draw_gaps(3, 5.0, 4.0, rng)
    assert rng.calls == [{"shape": 4.0, "scale": 0.05, "size": 3}]
    assert list(gaps) == [0.1, 0.2, 0.3]  # raw gaps are not rescaled


def test_arrivals_rescale_cumulative_gaps_to_n_over_rate():
    # Gaps 0.5, 1, 0.25, 2.25 sum to 4; the target N / rate = 4 / 2 = 2 halves every time:
    # cumsum 0.5, 1.5, 1.75, 4 -> 0.25, 0.75, 0.875, 2. Burstiness 0.5: shape 0.5, scale 1.
    rng = StubRng([0.5, 1.0, 0.25, 2.25])
    times = make_arrival_times(4, 2.0, 0.5, rng)
    assert rng.calls == [{"shape": 0.5, "scale": 1.0, "size": 4}]
    assert list(times) == [0.25, 0.75, 0.875, 2.0]


def test_seeded_arrivals_match_the_rescaled_gamma_draws():
    n, rate, burstiness = 6, 5.0, 2.0
    # The same seed draws the same gaps: Gamma(shape 2, scale 1 / (5 * 2) = 0.1).
    gaps = np.random.default_rng(3).gamma(shape=2.0, scale=0.1, size=n)
    expected = np.cumsum(gaps) * (n / rate) / gaps.sum()
    times = make_arrival_times(n, rate, burstiness, np.random.default_rng(3))
    assert times == pytest.approx(expected, rel=1e-12)
    assert times[-1] == n / rate

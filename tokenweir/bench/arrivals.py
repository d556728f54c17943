"""Request arrival schedules for a fixed offered rate, with vLLM `bench serve` semantics.

Gaps between arrivals are gamma distributed with shape = burstiness and
scale = 1 / (rate * burstiness), so the mean gap is always 1 / rate:
burstiness 1 is a Poisson process (exponential gaps), < 1 burstier, > 1 smoother,
inf a fixed gap. The cumulative times are then rescaled so the last request lands at
exactly N / rate: a plain sum of N random gaps misses that target by a few percent,
which would make throughput numbers drift with the seed.
"""

import math

import numpy as np


def draw_gaps(num_requests: int, rate: float, burstiness: float,
              rng: np.random.Generator) -> np.ndarray:
    """Raw inter-arrival gaps in seconds, before rescaling; the first precedes request 0."""
    if not rate > 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if math.isinf(rate):
        return np.zeros(num_requests)
    if math.isinf(burstiness):
        return np.full(num_requests, 1.0 / rate)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num_requests)


def make_arrival_times(num_requests: int, rate: float, burstiness: float,
                       rng: np.random.Generator) -> np.ndarray:
    """Send times in seconds from the benchmark start; all zero for an infinite rate."""
    gaps = draw_gaps(num_requests, rate, burstiness, rng)
    if num_requests == 0 or math.isinf(rate):
        return gaps
    times = np.cumsum(gaps)
    target = num_requests / rate
    times *= target / times[-1]
    # The product above can be off by one ulp; pin the last arrival so the total offered
    # duration is exactly N / rate.
    times[-1] = target
    return times

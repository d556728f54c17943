"""The rate-step arrival option of benchmarks/batching_slo.py (the load step of its evaluation)."""

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "batching_slo", Path(__file__).resolve().parents[2] / "benchmarks" / "batching_slo.py")
batching_slo = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(batching_slo)


def test_gaps_before_the_step_are_scaled_by_one_rate_and_after_by_the_other():
    times = batching_slo.rate_step_arrivals([10.0, 12.0, 16.0, 20.0, 21.0], 2, 0.5, 4.0)
    # Gaps 2, 4, 4, 1: the first (before request 2) slowed 2x, those from request 2 on 4x faster.
    assert times == pytest.approx([0.0, 4.0, 5.0, 6.0, 6.25])


def test_a_bad_rate_step_is_refused():
    with pytest.raises(ValueError, match=r"rate step needs scales > 0 and an index in \[0, 2\]"):
        batching_slo.rate_step_arrivals([0.0, 1.0], 3, 1.0, 2.0)
    with pytest.raises(ValueError, match="rate step needs scales > 0"):
        batching_slo.rate_step_arrivals([0.0, 1.0], 1, 0.0, 2.0)

"""The real-engine load step of benchmarks/batching_slo.py: a measured run put in the form its
windowed p99 (the simulated step's definition) reads."""

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "batching_slo", Path(__file__).resolve().parents[2] / "benchmarks" / "batching_slo.py")
batching_slo = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(batching_slo)


def test_each_inter_token_gap_is_a_one_row_step_from_where_it_starts_with_the_limits_then():
    bench = {"ttfts": [0.5, 1.0, 0.2], "itls": [[0.1, 0.3], [0.2], []], "output_lens": [3, 2, 0]}
    gauges = [{"time": 0.0, "budget": 512.0, "cap": 8.0}, {"time": 2.0, "budget": 128.0, "cap": 4.0}]
    series = batching_slo.measured_series(bench, [0.0, 1.5, 2.0], gauges)
    # Request 0: first token at 0.5, gaps from 0.5 and 0.6; request 1: first token at 2.5, one gap
    # from it, under the second poll's limits; request 2 failed (no tokens) and adds nothing.
    assert [step[1:4] for step in series["steps"]] == [(512.0, 8.0, 1), (512.0, 8.0, 1), (128.0, 4.0, 1)]
    assert [(step[0], step[4]) for step in series["steps"]] == [(0.5, 0.1), (pytest.approx(0.6), 0.3),
                                                               (2.5, 0.2)]
    assert [f[0] for f in series["finished"]] == pytest.approx([0.9, 2.7])
    assert [f[1] for f in series["finished"]] == pytest.approx([0.2, 0.2])
    assert series["end"] == pytest.approx(2.7)
    window = batching_slo.windowed(series, 1.0, points=3)
    # At t = 1.0 the window [0, 1) holds the gaps of 0.1 and 0.3 s: its p99 is the larger.
    assert window["t"][0] == 1.0 and window["p99_itl_ms"][0] == 300.0 and window["cap"][0] == 8.0


def test_a_gap_before_the_first_poll_takes_its_limits():
    bench = {"ttfts": [0.1], "itls": [[0.1]], "output_lens": [2]}
    series = batching_slo.measured_series(bench, [0.0], [{"time": 1.0, "budget": 64.0, "cap": 2.0}])
    assert series["steps"][0][1:3] == (64.0, 2.0)


def test_settling_is_the_last_window_over_the_bound_and_none_if_the_run_ends_over_it():
    w = {"t": [1.0, 2.0, 3.0, 4.0, 5.0], "p99_itl_ms": [300.0, 100.0, 300.0, 100.0, None]}
    assert batching_slo.settle_time(w, 1.5, 250.0) == 1.5  # over at 3.0, under from 4.0 on
    assert batching_slo.settle_time(w, 3.5, 250.0) == 0.0
    w["p99_itl_ms"][3] = 260.0
    assert batching_slo.settle_time(w, 1.5, 250.0) is None


def test_real_rounds_rotate_the_order_of_the_configurations_and_record_them_in_one_order():
    # On a machine that drifts within a command, the configuration run first in every round
    # gains: each one is first equally often, and every round's record keeps the given order.
    configs = {"slo": None, "256/32": None, "1024/32": None}
    orders = [batching_slo.round_order(configs, i) for i in range(6)]
    assert orders[:3] == [["slo", "256/32", "1024/32"], ["256/32", "1024/32", "slo"], ["1024/32", "slo", "256/32"]]
    assert orders[3:] == orders[:3]
    assert all(sorted(o) == sorted(configs) for o in orders)

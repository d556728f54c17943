"""Serving metrics against hand-computed values (times in the fixture are seconds, results ms)."""

import math

import pytest

from tokenweir.bench.serve_metrics import (RequestRecord, compute_metrics, metrics_to_dict,
                                           percentile_key)

PERCENTILES = (50, 75, 90, 99)


def fixture_records() -> list[RequestRecord]:
    return [
        # TPOT = (0.5 - 0.1) / 4 = 0.1
        RequestRecord(True, prompt_len=10, output_tokens=5, ttft=0.1, latency=0.5,
                      itl=[0.1, 0.1, 0.1, 0.1]),
        # TPOT = (0.6 - 0.2) / 2 = 0.2
        RequestRecord(True, prompt_len=20, output_tokens=3, ttft=0.2, latency=0.6,
                      itl=[0.2, 0.2]),
        # One token: no TPOT, no ITL.
        RequestRecord(True, prompt_len=30, output_tokens=1, ttft=0.3, latency=0.3),
        # Failed with zero latencies: it would meet every SLO if it were counted.
        RequestRecord(False, prompt_len=40, error="HTTP 500"),
    ]


def metrics(slos=None):
    return compute_metrics(fixture_records(), duration_s=2.0, percentiles=PERCENTILES,
                           slos_ms=slos)


def test_counts_and_throughputs():
    m = metrics()
    assert (m.completed, m.failed) == (3, 1)
    assert m.total_input_tokens == 60  # the failed request's 40 are not counted
    assert m.total_output_tokens == 9
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(4.5)
    assert m.total_token_throughput == pytest.approx(34.5)
    assert m.request_goodput is None


def test_ttft_stats():
    s = metrics().stats["ttft"]  # [100, 200, 300] ms
    assert s.mean == pytest.approx(200)
    assert s.median == pytest.approx(200)
    assert s.std == pytest.approx(math.sqrt(20000 / 3))
    # Linear interpolation at rank p/100 * (n - 1).
    assert s.percentiles == pytest.approx({50: 200, 75: 250, 90: 280, 99: 298})


def test_tpot_excludes_single_token_requests():
    s = metrics().stats["tpot"]  # [100, 200] ms
    assert s.mean == pytest.approx(150)
    assert s.median == pytest.approx(150)
    assert s.std == pytest.approx(50)
    assert s.percentiles == pytest.approx({50: 150, 75: 175, 90: 190, 99: 199})


def test_itl_is_pooled_over_requests():
    s = metrics().stats["itl"]  # [100, 100, 100, 100, 200, 200] ms
    assert s.mean == pytest.approx(400 / 3)
    assert s.median == pytest.approx(100)
    assert s.std == pytest.approx(math.sqrt(20000 / 9))
    assert s.percentiles == pytest.approx({50: 100, 75: 175, 90: 200, 99: 200})


def test_e2el_stats():
    s = metrics().stats["e2el"]  # [500, 600, 300] ms
    assert s.mean == pytest.approx(1400 / 3)
    assert s.median == pytest.approx(500)
    assert s.std == pytest.approx(math.sqrt(140000 / 9))
    assert s.percentiles == pytest.approx({50: 500, 75: 550, 90: 580, 99: 598})


@pytest.mark.parametrize("slos, good", [
    ({"ttft": 150}, 1),                  # only the 100 ms request
    ({"ttft": 200}, 2),                  # bounds are inclusive
    ({"tpot": 150}, 2),                  # 100 ms and the one-token request
    ({"tpot": 250}, 3),
    ({"e2el": 450}, 1),                  # only the 300 ms request
    ({"ttft": 250, "tpot": 150}, 1),     # the 200 ms-TTFT request misses TPOT
    ({"ttft": 300, "e2el": 550}, 2),
    ({"ttft": 0, "tpot": 0, "e2el": 0}, 0),
])
def test_goodput(slos, good):
    assert metrics(slos).request_goodput == pytest.approx(good / 2.0)


def test_unknown_slo_rejected():
    with pytest.raises(ValueError):
        metrics({"itl": 10})


def test_all_failed_reports_zeros():
    m = compute_metrics([RequestRecord(False, 5, error="boom")], 1.0, PERCENTILES)
    assert (m.completed, m.failed, m.total_output_tokens) == (0, 1, 0)
    assert m.stats["ttft"].mean == 0 and m.stats["itl"].percentiles[99] == 0


def test_duration_must_be_positive():
    with pytest.raises(ValueError):
        compute_metrics(fixture_records(), 0.0)


def test_result_keys_follow_vllm_names():
    d = metrics_to_dict(compute_metrics(fixture_records(), 2.0, (50, 99.9)), ["ttft", "itl"])
    assert d["mean_ttft_ms"] == pytest.approx(200)
    assert d["p50_ttft_ms"] == pytest.approx(200)
    assert "p99.9_itl_ms" in d and "std_itl_ms" in d
    assert "mean_tpot_ms" not in d  # not selected
    assert d["completed"] == 3 and d["request_goodput"] is None
    assert percentile_key(99.0) == "p99" and percentile_key(99.5) == "p99.5"

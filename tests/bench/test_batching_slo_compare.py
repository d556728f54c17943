"""benchmarks/batching_slo.py's verdict: slo against the best static pair meeting the target, by
the issue's criterion (p99 TPOT) and by the one slo holds itself to (p99 TPOT and ITL)."""

import importlib.util
from pathlib import Path

_SPEC = importlib.util.spec_from_file_location(
    "batching_slo", Path(__file__).resolve().parents[2] / "benchmarks" / "batching_slo.py")
batching_slo = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(batching_slo)


def _run(duration_s, tpot, itl, completed=100, **pair):
    # request_throughput rounded as simulate() rounds it: it cannot tell these runs apart.
    return {"completed": completed, "duration_s": duration_s, "request_throughput": round(completed / duration_s, 4),
            "p99_tpot_ms": tpot, "p99_itl_ms": itl, **pair}


def _pair(b, s):
    return {"max_num_batched_tokens": b, "max_num_seqs": s}


def test_the_best_static_by_each_criterion_and_slo_against_it_from_the_durations():
    entry = {"static": [_run(128.486, 244, 937, **_pair(1024, 32)),   # meets TPOT only, fastest
                        _run(130.360, 160, 177, **_pair(128, 32)),    # meets both
                        _run(130.100, 170, 251, **_pair(256, 32)),    # ITL just over
                        _run(120.000, 260, 300, **_pair(2048, 64))],  # meets neither
             "slo": _run(129.217, 212, 242)}
    c = batching_slo.compare(entry, 250.0)
    assert c["tpot"]["best_static"] == "1024/32" and c["tpot"]["statics_meeting"] == 3
    assert c["tpot_and_itl"]["best_static"] == "128/32" and c["tpot_and_itl"]["statics_meeting"] == 1
    assert c["tpot"]["slo_meets"] and c["tpot_and_itl"]["slo_meets"]
    assert c["tpot"]["slo_vs_best_pct"] == round(100 * (128.486 / 129.217 - 1), 3)  # -0.566
    assert c["tpot_and_itl"]["slo_vs_best_pct"] == round(100 * (130.360 / 129.217 - 1), 3)  # +0.885
    assert batching_slo.best_static(entry["static"], "tpot_and_itl", 250.0) is entry["static"][1]


def test_a_difference_below_the_rounding_of_req_s_is_decided_by_the_durations():
    # 300 requests ending 28 ms apart in 848 s: 0.3538 req/s both, rounded.
    entry = {"static": [_run(847.900, 96, 156, completed=300, **_pair(128, 8))],
             "slo": _run(847.928, 132, 239, completed=300)}
    assert entry["static"][0]["request_throughput"] == entry["slo"]["request_throughput"]
    assert batching_slo.compare(entry, 250.0)["tpot_and_itl"]["slo_vs_best_pct"] == -0.003


def test_slo_missing_a_criterion_and_no_static_meeting_it_are_said_so():
    entry = {"static": [_run(100.0, 300, 900, **_pair(2048, 256))], "slo": _run(101.0, 240, 260)}
    c = batching_slo.compare(entry, 250.0)
    assert c["tpot"]["slo_meets"] and not c["tpot_and_itl"]["slo_meets"]
    assert c["tpot"]["best_static"] is None and c["tpot"]["slo_vs_best_pct"] is None
    assert c["tpot"]["statics_meeting"] == 0

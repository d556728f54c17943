"""`--slo-mix` parsing: every bad class is a ValueError naming the class and the field before the
run starts (a value the request would refuse used to pass here and fail every request of its
class), and a good one carries its values to the request's hints."""

from __future__ import annotations

import pytest

from tokenweir.bench.slo_mix import SLOClass, assign_classes, parse_slo_mix
from tokenweir.request import SchedulingHints

INT_RANGE = r"\[-2147483648, 2147483647\]"
MS = "a finite number of milliseconds > 0"


@pytest.mark.parametrize("items, message", [
    (["a:1:priority=x"], rf"--slo-mix a: priority must be an integer in {INT_RANGE}, got 'x'$"),
    (["a:1:priority=2147483648"], rf"--slo-mix a: priority must be an integer in {INT_RANGE}, got '2147483648'$"),
    (["a:1:priority=-2147483649"], rf"--slo-mix a: priority must be an integer in {INT_RANGE}"),
    (["a:1:ttft=abc"], rf"--slo-mix a: ttft must be {MS}, got 'abc'$"),
    (["a:1:ttft=inf"], rf"--slo-mix a: ttft must be {MS}, got 'inf'$"),
    (["a:1:tpot=nan"], rf"--slo-mix a: tpot must be {MS}, got 'nan'$"),
    (["a:1:tpot=0"], rf"--slo-mix a: tpot must be {MS}, got '0'$"),
    # > 0 in ms but 0 once in seconds, as the request carries it.
    (["a:1:deadline=1e-323"], rf"--slo-mix a: deadline must be {MS}, got '1e-323'$"),
    (["a:1:tenant="], r"--slo-mix a: tenant must be a non-empty name of at most 256 characters, got ''$"),
    (["a:1:tenant=" + "t" * 257], r"--slo-mix a: tenant must be a non-empty name of at most 256 characters"),
    (["a:1:ttft=1:ttft=2"], r"--slo-mix a: ttft is given twice$"),
    (["a:1:tenant=x:tenant=y"], r"--slo-mix a: tenant is given twice$"),
    (["a:inf"], r"--slo-mix a: the fraction must be a finite number > 0, got 'inf'$"),
    (["a:0"], r"--slo-mix a: the fraction must be a finite number > 0, got '0'$"),
    (["a:1e308", "b:1e308"], r"--slo-mix: the fractions must have a finite sum"),
    (["a:1:color=red"], r"--slo-mix a: bad option 'color=red'; keys: priority, ttft, tpot, deadline, tenant$"),
    (["a:1", "a:2"], r"--slo-mix class names must be distinct"),
])
def test_a_bad_class_is_refused_naming_its_field(items, message):
    with pytest.raises(ValueError, match=message):
        parse_slo_mix(items)


def test_the_extremes_accepted_are_ones_every_request_accepts():
    classes = parse_slo_mix(["a:1:priority=-2147483648:tenant=" + "t" * 256 + ":ttft=0.5:tpot=1e6:deadline=9",
                             "b:3:priority=2147483647"])
    assert classes == [SLOClass("a", 1.0, -2**31, 0.5, 1e6, 9.0, "t" * 256), SLOClass("b", 3.0, 2**31 - 1)]
    assert classes[0].hints() == SchedulingHints(priority=-2**31, tenant="t" * 256, ttft_slo=0.0005,
                                                 tpot_slo=1000.0, deadline=0.009)
    assert set(assign_classes(50, classes, seed=0)) == set(classes)


def test_the_class_report_gives_each_class_its_longest_wait_for_a_first_token():
    from tokenweir.bench.serve_metrics import RequestRecord
    from tokenweir.bench.slo_mix import class_report, format_class_table
    fast, slow = parse_slo_mix(["fast:1:ttft=1000", "slow:1"])
    records = [RequestRecord(True, 8, 4, ttft=0.5, latency=1.0), RequestRecord(True, 8, 4, ttft=7.5, latency=9.0),
               RequestRecord(True, 8, 4, ttft=30.0, latency=31.0), RequestRecord(False, 8, error="x")]
    report = class_report(records, [fast, fast, slow, slow], duration_s=40.0)
    assert report["fast"]["max_ttft_ms"] == 7500.0 and report["slow"]["max_ttft_ms"] == 30000.0
    assert "max TTFT" in format_class_table(report).splitlines()[0]


def test_a_deadline_counts_in_the_class_attainment_and_goodput():
    # A deadline-only class scored 100% however late its requests ended.
    from tokenweir.bench.serve_metrics import RequestRecord
    from tokenweir.bench.slo_mix import class_report
    (due,) = parse_slo_mix(["due:1:deadline=2000"])
    records = [RequestRecord(True, 8, 4, ttft=0.5, latency=1.5), RequestRecord(True, 8, 4, ttft=0.5, latency=2.5)]
    report = class_report(records, [due, due], duration_s=10.0)["due"]
    assert (report["deadline_attainment"], report["slo_attainment"], report["goodput"]) == (0.5, 0.5, 0.1)
    assert report["ttft_attainment"] == report["tpot_attainment"] == 1.0

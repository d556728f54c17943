"""The printed result table on a hand-built result."""

from tokenweir.bench.serve_metrics import BenchmarkMetrics, MetricStats
from tokenweir.bench.serve_report import format_table


def row(label: str, value: str) -> str:
    # Labels left-aligned in 40 columns, then a space and the value in 10.
    return f"{label:<40} {value:<10}"


def metrics(goodput: float | None) -> BenchmarkMetrics:
    def stats(base: float) -> MetricStats:
        return MetricStats(mean=base, median=base + 1, std=base / 10,
                           percentiles={50.0: base + 1, 99.0: base * 3, 99.9: base * 4})

    return BenchmarkMetrics(
        duration_s=12.5, completed=7, failed=1, total_input_tokens=1234, total_output_tokens=567,
        request_throughput=0.56, request_goodput=goodput, output_throughput=45.36,
        total_token_throughput=144.08,
        stats={"ttft": stats(120.0), "tpot": stats(20.0), "itl": stats(18.5), "e2el": stats(900.0)})


def test_table_rows_and_sections():
    lines = format_table(metrics(goodput=0.25), ["ttft", "itl"], 4, "inf").splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[-1] == "=" * 50
    for expected in [
        row("Successful requests:", "7"),
        row("Failed requests:", "1"),
        row("Maximum request concurrency:", "4"),
        row("Request rate configured (RPS):", "inf"),
        row("Benchmark duration (s):", "12.50"),
        row("Total input tokens:", "1234"),
        row("Total generated tokens:", "567"),
        row("Request throughput (req/s):", "0.56"),
        row("Request goodput (req/s):", "0.25"),
        row("Output token throughput (tok/s):", "45.36"),
        row("Total token throughput (tok/s):", "144.08"),
        "---------------Time to First Token----------------",
        row("Mean TTFT (ms):", "120.00"),
        row("Median TTFT (ms):", "121.00"),
        row("Std TTFT (ms):", "12.00"),
        row("P50 TTFT (ms):", "121.00"),
        row("P99 TTFT (ms):", "360.00"),
        row("P99.9 TTFT (ms):", "480.00"),
        "---------------Inter-token Latency----------------",
        row("Mean ITL (ms):", "18.50"),
        row("P99 ITL (ms):", "55.50"),
    ]:
        assert expected in lines, expected
    # Sections come in the order asked for; unselected metrics are left out.
    assert lines.index(row("Mean TTFT (ms):", "120.00")) < lines.index(row("Mean ITL (ms):", "18.50"))
    assert not any("TPOT" in line or "E2EL" in line for line in lines)


def test_no_goodput_row_without_slos_and_no_concurrency_limit():
    lines = format_table(metrics(goodput=None), ["e2el"], None, "trace").splitlines()
    assert not any(line.startswith("Request goodput") for line in lines)
    assert row("Maximum request concurrency:", "None") in lines
    assert row("Request rate configured (RPS):", "trace") in lines
    assert row("P99 E2EL (ms):", "2700.00") in lines

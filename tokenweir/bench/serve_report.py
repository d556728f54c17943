"""The printed result table of `bench serve`, laid out like vLLM's so outputs compare by eye."""

from tokenweir.bench.serve_metrics import BenchmarkMetrics, percentile_key

WIDTH = 50
SECTION_TITLES = {
    "ttft": ("Time to First Token", "TTFT"),
    "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
    "itl": ("Inter-token Latency", "ITL"),
    "e2el": ("End-to-end Latency", "E2EL"),
}


def _row(label: str, value: object) -> str:
    if isinstance(value, float):
        return f"{label:<40} {value:<10.2f}"
    return f"{label:<40} {value!s:<10}"


def format_table(m: BenchmarkMetrics, selected: list[str], max_concurrency: int | None,
                 request_rate: str) -> str:
    lines = [
        f"{' Serving Benchmark Result ':=^{WIDTH}}",
        _row("Successful requests:", m.completed),
        _row("Failed requests:", m.failed),
        _row("Maximum request concurrency:", max_concurrency),
        _row("Request rate configured (RPS):", request_rate),
        _row("Benchmark duration (s):", m.duration_s),
        _row("Total input tokens:", m.total_input_tokens),
        _row("Total generated tokens:", m.total_output_tokens),
        _row("Request throughput (req/s):", m.request_throughput),
    ]
    if m.request_goodput is not None:
        lines.append(_row("Request goodput (req/s):", m.request_goodput))
    lines += [
        _row("Output token throughput (tok/s):", m.output_throughput),
        _row("Total token throughput (tok/s):", m.total_token_throughput),
    ]
    for name in selected:
        title, short = SECTION_TITLES[name]
        s = m.stats[name]
        lines.append(f"{title:-^{WIDTH}}")
        lines.append(_row(f"Mean {short} (ms):", s.mean))
        lines.append(_row(f"Median {short} (ms):", s.median))
        lines.append(_row(f"Std {short} (ms):", s.std))
        for p, v in s.percentiles.items():
            lines.append(_row(f"{percentile_key(p).upper()} {short} (ms):", v))
    lines.append("=" * WIDTH)
    return "\n".join(lines)

"""Serving metrics over per-request records, with the definitions of vLLM's `bench serve`.

All functions are pure so they can be checked against hand-computed fixtures. Times in
records are seconds; reported latency statistics are milliseconds.

- TTFT: send to the first streamed chunk with a non-empty `choices` list, text or not.
- TPOT: (E2EL - TTFT) / (output_tokens - 1), only for requests with more than one token.
- ITL: every gap between consecutive such chunks, pooled over all requests (a chunk may
  carry several tokens, so ITL and TPOT differ when a server batches its stream).
- E2EL: send to the last chunk with choices (the usage summary after it does not count).
Failed requests count only in `failed`.
"""

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

METRIC_NAMES = ("ttft", "tpot", "itl", "e2el")
SLO_NAMES = ("ttft", "tpot", "e2el")


@dataclass(slots=True)
class RequestRecord:
    success: bool
    prompt_len: int
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    # Gaps between consecutive chunks with choices after the first.
    itl: list[float] = field(default_factory=list)
    generated_text: str = ""
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


@dataclass(frozen=True, slots=True)
class MetricStats:
    """One latency metric in milliseconds."""
    mean: float
    median: float
    std: float
    percentiles: dict[float, float]


@dataclass(frozen=True, slots=True)
class BenchmarkMetrics:
    duration_s: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    # None when no SLO was given.
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    stats: dict[str, MetricStats]


def make_stats(values_s: Sequence[float], percentiles: Iterable[float]) -> MetricStats:
    """Mean, median, population std and linear-interpolated percentiles, seconds in, ms out.

    An empty sample reports zeros, as vLLM does (e.g. TPOT when every output was one token).
    """
    ms = np.asarray(values_s, dtype=float) * 1000.0 if len(values_s) else np.zeros(1)
    return MetricStats(
        mean=float(np.mean(ms)),
        median=float(np.median(ms)),
        std=float(np.std(ms)),
        percentiles={p: float(np.percentile(ms, p)) for p in percentiles},
    )


def get_metric_values(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Per-metric samples in seconds over successful requests."""
    ok = [r for r in records if r.success]
    return {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.latency for r in ok],
    }


def is_good(record: RequestRecord, slos_ms: dict[str, float]) -> bool:
    """Whether a successful request meets every given SLO (inclusive bounds, in ms).

    A single-token request has no TPOT and so meets any TPOT SLO (vLLM counts its TPOT as 0).
    """
    if not record.success:
        return False
    observed = {"ttft": record.ttft, "tpot": record.tpot or 0.0, "e2el": record.latency}
    return all(observed[name] * 1000.0 <= bound for name, bound in slos_ms.items())


def compute_metrics(records: Sequence[RequestRecord], duration_s: float,
                    percentiles: Iterable[float] = (99.0,),
                    slos_ms: dict[str, float] | None = None) -> BenchmarkMetrics:
    if duration_s <= 0:
        raise ValueError(f"benchmark duration must be > 0, got {duration_s}")
    unknown = set(slos_ms or {}) - set(SLO_NAMES)
    if unknown:
        raise ValueError(f"unknown SLO metric(s) {sorted(unknown)}; choose from {SLO_NAMES}")
    ok = [r for r in records if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    percentiles = list(percentiles)
    values = get_metric_values(records)
    goodput = None
    if slos_ms:
        goodput = sum(is_good(r, slos_ms) for r in ok) / duration_s
    return BenchmarkMetrics(
        duration_s=duration_s,
        completed=len(ok),
        failed=len(records) - len(ok),
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration_s,
        request_goodput=goodput,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        stats={name: make_stats(values[name], percentiles) for name in METRIC_NAMES},
    )


def percentile_key(p: float) -> str:
    """vLLM's key spelling: 99 -> "p99", 99.9 -> "p99.9"."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def metrics_to_dict(m: BenchmarkMetrics, selected: Iterable[str] = METRIC_NAMES) -> dict:
    """Flat result fields under vLLM's names, e.g. `mean_ttft_ms`, `p99_itl_ms`."""
    out: dict = {
        "duration": m.duration_s,
        "completed": m.completed,
        "failed": m.failed,
        "total_input_tokens": m.total_input_tokens,
        "total_output_tokens": m.total_output_tokens,
        "request_throughput": m.request_throughput,
        "request_goodput": m.request_goodput,
        "output_throughput": m.output_throughput,
        "total_token_throughput": m.total_token_throughput,
    }
    for name in selected:
        s = m.stats[name]
        out[f"mean_{name}_ms"] = s.mean
        out[f"median_{name}_ms"] = s.median
        out[f"std_{name}_ms"] = s.std
        for p, v in s.percentiles.items():
            out[f"{percentile_key(p)}_{name}_ms"] = v
    return out

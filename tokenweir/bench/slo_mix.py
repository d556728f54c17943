"""`--slo-mix`: request classes with their own priority, SLOs and tenant, and the per-class
report (SLO attainment, goodput, tokens served) of `bench serve` and `tokenweir simulate`.

A class is `NAME:FRACTION[:key=value...]` with keys `priority`, `ttft` and `tpot` (SLOs, ms),
`deadline` (ms) and `tenant`, each at most once and in the ranges a request accepts (checked
here, before the run: a finite fraction > 0; priority in [-2^31, 2^31 - 1]; times finite > 0;
tenant 1-256 characters), e.g.

    --slo-mix interactive:0.3:priority=0:ttft=1000:tpot=150 batch:0.7:priority=1:ttft=60000:tpot=2000

Each request draws its class from its own seeded generator, so the workload (prompts, lengths,
arrivals) is the same with and without a mix. The SLOs travel with the request (`ttft_slo_ms`,
...: the scheduler sees them) and are what the request is scored against in the report.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import numpy as np

from tokenweir.bench.serve_metrics import RequestRecord
from tokenweir.request import MAX_KEY_CHARS, PRIORITY_MAX, PRIORITY_MIN, SchedulingHints

_KEYS = ("priority", "ttft", "tpot", "deadline", "tenant")
# The class draw's generator is seeded apart from the workload's (seed + this).
_SEED_OFFSET = 7919


@dataclass(frozen=True, slots=True)
class SLOClass:
    name: str
    fraction: float
    priority: int = 0
    ttft_ms: Optional[float] = None
    tpot_ms: Optional[float] = None
    deadline_ms: Optional[float] = None
    tenant: Optional[str] = None

    def payload_fields(self) -> dict:
        """The request body fields (tokenweir's extensions of OpenAI's API)."""
        fields = {"priority": self.priority, "ttft_slo_ms": self.ttft_ms, "tpot_slo_ms": self.tpot_ms,
                  "deadline_ms": self.deadline_ms, "tenant": self.tenant}
        return {k: v for k, v in fields.items() if v is not None}

    def hints(self) -> SchedulingHints:
        def s(ms: Optional[float]) -> Optional[float]:
            return None if ms is None else ms / 1000.0

        return SchedulingHints(priority=self.priority, tenant=self.tenant, ttft_slo=s(self.ttft_ms),
                               tpot_slo=s(self.tpot_ms), deadline=s(self.deadline_ms))


def _option(name: str, key: str, text: str) -> object:
    """One option's value, checked as the request will check it (so that a bad mix stops before
    the run, naming the class and the field, rather than failing every request of the class)."""
    def bad(rule: str) -> ValueError:
        return ValueError(f"--slo-mix {name}: {key} must be {rule}, got {text!r:.80}")

    if key == "tenant":
        if not 0 < len(text) <= MAX_KEY_CHARS:
            raise bad(f"a non-empty name of at most {MAX_KEY_CHARS} characters")
        return text
    if key == "priority":
        rule = f"an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}]"
        try:
            priority = int(text)
        except ValueError:
            raise bad(rule) from None
        if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
            raise bad(rule)
        return priority
    rule = "a finite number of milliseconds > 0"
    try:
        ms = float(text)
    except ValueError:
        raise bad(rule) from None
    # In seconds (what the request carries) it must stay > 0 too: 1e-323 ms would not.
    if not (math.isfinite(ms) and ms / 1000.0 > 0):
        raise bad(rule)
    return ms


def parse_slo_mix(items: Optional[Sequence[str]]) -> list[SLOClass]:
    classes = []
    for item in items or []:
        name, _, rest = item.partition(":")
        fraction_text, _, options = rest.partition(":")
        if not name or not fraction_text:
            raise ValueError(f"bad --slo-mix class {item!r}; use NAME:FRACTION[:key=value...]")
        try:
            fraction = float(fraction_text)
        except ValueError:
            raise ValueError(f"--slo-mix {name}: the fraction {fraction_text!r} is not a number") from None
        if not (math.isfinite(fraction) and fraction > 0):
            raise ValueError(f"--slo-mix {name}: the fraction must be a finite number > 0, got {fraction_text!r}")
        values: dict = {}
        for option in filter(None, options.split(":")):
            key, sep, value = option.partition("=")
            if not sep or key not in _KEYS:
                raise ValueError(f"--slo-mix {name}: bad option {option!r}; keys: {', '.join(_KEYS)}")
            field_name = key if key in ("priority", "tenant") else f"{key}_ms"
            if field_name in values:
                raise ValueError(f"--slo-mix {name}: {key} is given twice")
            values[field_name] = _option(name, key, value)
        classes.append(SLOClass(name, fraction, **values))
    names = [c.name for c in classes]
    if len(set(names)) != len(names):
        raise ValueError(f"--slo-mix class names must be distinct, got {names}")
    # The draw normalizes by the sum, which must stay finite (1e308 twice does not).
    if not math.isfinite(sum(c.fraction for c in classes)):
        raise ValueError(f"--slo-mix: the fractions must have a finite sum, got {[c.fraction for c in classes]}")
    return classes


def assign_classes(num: int, classes: Sequence[SLOClass], seed: int) -> list[SLOClass]:
    """One class per request, drawn by the fractions (normalized)."""
    weights = np.array([c.fraction for c in classes], dtype=float)
    rng = np.random.default_rng(seed + _SEED_OFFSET)
    picks = rng.choice(len(classes), size=num, p=weights / weights.sum())
    return [classes[i] for i in picks]


def class_report(records: Sequence[RequestRecord], assigned: Sequence[SLOClass], duration_s: float) -> dict:
    """Per class: requests, completed, TTFT / TPOT / deadline attainment (met / requests; a
    failed request misses each; a deadline is met when the request ends within it), goodput
    (requests meeting all of the class's SLOs and its deadline per second), latency medians and
    maxima, output tokens and their share of all served."""
    total_tokens = sum(r.output_tokens for r in records if r.success) or 1
    report = {}
    for cls in dict.fromkeys(assigned):
        mine = [r for r, c in zip(records, assigned) if c is cls]
        ok = [r for r in mine if r.success]
        ttft_met = [r.success and (cls.ttft_ms is None or r.ttft * 1e3 <= cls.ttft_ms) for r in mine]
        tpot_met = [r.success and (cls.tpot_ms is None or (r.tpot or 0.0) * 1e3 <= cls.tpot_ms) for r in mine]
        deadline_met = [r.success and (cls.deadline_ms is None or r.latency * 1e3 <= cls.deadline_ms) for r in mine]
        all_met = [a and b and c for a, b, c in zip(ttft_met, tpot_met, deadline_met)]
        tokens = sum(r.output_tokens for r in ok)
        report[cls.name] = {
            "requests": len(mine), "completed": len(ok), "failed": len(mine) - len(ok),
            "ttft_slo_ms": cls.ttft_ms, "tpot_slo_ms": cls.tpot_ms, "deadline_ms": cls.deadline_ms,
            "priority": cls.priority, "tenant": cls.tenant,
            "ttft_attainment": float(np.mean(ttft_met)) if mine else None,
            "tpot_attainment": float(np.mean(tpot_met)) if mine else None,
            "deadline_attainment": float(np.mean(deadline_met)) if mine else None,
            "slo_attainment": float(np.mean(all_met)) if mine else None,
            "goodput": sum(all_met) / duration_s,
            "median_ttft_ms": float(np.median([r.ttft for r in ok]) * 1e3) if ok else None,
            "p99_ttft_ms": float(np.percentile([r.ttft for r in ok], 99) * 1e3) if ok else None,
            "median_tpot_ms": _median_ms([r.tpot for r in ok if r.tpot is not None]),
            # The longest wait for service: arrival to first token (queueing included).
            "max_ttft_ms": max(r.ttft for r in ok) * 1e3 if ok else None,
            "max_e2el_ms": max(r.latency for r in ok) * 1e3 if ok else None,
            "output_tokens": tokens, "output_token_share": tokens / total_tokens,
        }
    return report


def _median_ms(values: list[float]) -> Optional[float]:
    return float(np.median(values) * 1e3) if values else None


def format_class_table(report: dict) -> str:
    def f(v, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    lines = [f"{'class':<14}{'reqs':>6}{'fail':>6}{'TTFT ok':>9}{'TPOT ok':>9}{'SLO ok':>8}{'goodput':>9}"
             f"{'p50 TTFT':>10}{'max TTFT':>10}{'p50 TPOT':>10}{'max E2E':>10}{'tok share':>10}"]
    for name, r in report.items():
        lines.append(f"{name:<14}{r['requests']:>6}{r['failed']:>6}{f(r['ttft_attainment'], '.1%'):>9}"
                     f"{f(r['tpot_attainment'], '.1%'):>9}{f(r['slo_attainment'], '.1%'):>8}"
                     f"{r['goodput']:>9.3f}{f(r['median_ttft_ms'], '.0f'):>10}{f(r['max_ttft_ms'], '.0f'):>10}"
                     f"{f(r['median_tpot_ms'], '.0f'):>10}"
                     f"{f(r['max_e2el_ms'], '.0f'):>10}{r['output_token_share']:>10.1%}")
    return "\n".join(lines)

"""The engine's state over simulated time, step by step, reduced to a fixed number of points.

A long run takes hundreds of thousands of steps; the result keeps at most `max_points` buckets
of equal simulated time, each with the mean queue depths and KV usage of the steps that ended
in it, the preemptions that happened in it and the mean tokens per step. Bucketing depends only
on simulated times, so the series is as deterministic as the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TimeSeries:
    max_points: int
    times: list[float] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    swapped: list[int] = field(default_factory=list)
    kv_usage: list[float] = field(default_factory=list)
    preemptions: list[int] = field(default_factory=list)  # cumulative
    tokens: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.max_points < 1:
            raise ValueError(f"time series points must be >= 1, got {self.max_points}")

    def add(self, t: float, waiting: int, running: int, swapped: int, kv_usage: float,
            preemptions: int, tokens: int) -> None:
        self.times.append(t)
        self.waiting.append(waiting)
        self.running.append(running)
        self.swapped.append(swapped)
        self.kv_usage.append(kv_usage)
        self.preemptions.append(preemptions)
        self.tokens.append(tokens)

    def to_dict(self) -> dict[str, list[float]]:
        """Bucketed series: `time_s` is each bucket's end; empty buckets are left out."""
        out: dict[str, list[float]] = {k: [] for k in (
            "time_s", "num_waiting", "num_running", "num_swapped", "kv_cache_usage",
            "num_preemptions", "tokens_per_step", "num_steps")}
        if not self.times:
            return out
        start, end = 0.0, self.times[-1]
        width = (end - start) / self.max_points or 1.0
        i, n, previous_preemptions = 0, len(self.times), 0
        for b in range(self.max_points):
            bucket_end = end if b == self.max_points - 1 else start + (b + 1) * width
            j = i
            while j < n and self.times[j] <= bucket_end:
                j += 1
            if j == i:
                continue
            steps = j - i
            out["time_s"].append(round(bucket_end, 6))
            out["num_waiting"].append(round(sum(self.waiting[i:j]) / steps, 3))
            out["num_running"].append(round(sum(self.running[i:j]) / steps, 3))
            out["num_swapped"].append(round(sum(self.swapped[i:j]) / steps, 3))
            out["kv_cache_usage"].append(round(sum(self.kv_usage[i:j]) / steps, 4))
            out["num_preemptions"].append(self.preemptions[j - 1] - previous_preemptions)
            out["tokens_per_step"].append(round(sum(self.tokens[i:j]) / steps, 2))
            out["num_steps"].append(steps)
            previous_preemptions = self.preemptions[j - 1]
            i = j
        return out

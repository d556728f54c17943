"""Prometheus metrics (names in DESIGN.md, prefix `tokenweir:`) and the periodic stats log line.

Every metric lives in a `CollectorRegistry` of its own per engine, so several engines (tests,
one process serving two apps) never collide in prometheus_client's global registry. Buckets
follow vLLM's, so dashboards built for vLLM read tokenweir's histograms the same way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

from tokenweir.core.policies import priority_class
from tokenweir.core.preemption import PREEMPTION_KINDS
from tokenweir.core.scheduler import SchedulerStats
from tokenweir.engine.output import RequestOutput
from tokenweir.request import SchedulingHints

logger = logging.getLogger("tokenweir")

PREFIX = "tokenweir:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                         5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
FINISH_REASONS = ("stop", "length", "abort")
# Tenants the operator named (the keys file's) always get a label each; others, named by
# clients in the body, get one each up to this many, first come, and later ones share "other",
# so a client that invents tenant names cannot grow the scrape without bound.
MAX_TENANT_LABELS = 32
NO_TENANT, OTHER_TENANTS = "none", "other"

# Without this every counter and histogram also exports a `*_created` timestamp series, which
# vLLM's dashboards do not use and which doubles the scrape. (A process-wide switch.)
disable_created_metrics()


class CounterGrowth:
    """The growth of cumulative counters since the previous call: the scheduler keeps running
    totals; Prometheus counters and the log line's window each need what was added."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def take(self, **totals: int) -> dict[str, int]:
        growth = {name: total - self._last.get(name, 0) for name, total in totals.items()}
        self._last.update(totals)
        return growth


def iteration_token_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    """vLLM's step-size buckets up to the step budget: larger ones can never fill."""
    return tuple(b for b in _ITERATION_TOKEN_BUCKETS if b <= max_num_batched_tokens) or (1,)


def one_two_five_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's edges for request lengths)."""
    edges, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(edges)
            edges.append(mantissa * scale)
        scale *= 10


class TenantLabels:
    """A bounded set of tenant label values: the reserved tenants, then up to `limit` others."""

    def __init__(self, limit: int = MAX_TENANT_LABELS) -> None:
        self.limit = limit
        self._reserved: set[str] = set()
        self._known: set[str] = set()  # first come, at most `limit`

    def reserve(self, tenants: Iterable[str]) -> None:
        """Give each of `tenants` a label of its own whenever it comes, beyond the bound (the
        operator names them, so they are few). "none" and "other" keep their meaning."""
        self._reserved.update(t for t in tenants if t not in (NO_TENANT, OTHER_TENANTS))

    def __call__(self, tenant: Optional[str]) -> str:
        if tenant is None:
            return NO_TENANT
        if tenant in self._reserved or tenant in self._known:
            return tenant
        if len(self._known) < self.limit and tenant not in (NO_TENANT, OTHER_TENANTS):
            self._known.add(tenant)
            return tenant
        return OTHER_TENANTS


class ClassMetrics:
    """Per priority class and tenant: SLO attainment (TTFT and TPOT met or missed, for requests
    that set one), queue time and tokens served. Classes are `priority_class` (bounded), tenants
    TenantLabels (bounded)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, num_priority_classes: int) -> None:
        self.model_name = model_name
        self.num_priority_classes = num_priority_classes
        self.tenant_label = TenantLabels()
        labels = ["model_name", "priority_class", "tenant"]
        self.ttft_slo = Counter(PREFIX + "slo_ttft", "Finished requests with a TTFT SLO, by whether it was met.",
                                labels + ["outcome"], registry=registry)
        self.tpot_slo = Counter(PREFIX + "slo_tpot", "Finished requests with a TPOT SLO, by whether it was met.",
                                labels + ["outcome"], registry=registry)
        self.queue_time = Histogram(PREFIX + "class_request_queue_time_seconds",
                                    "Time from arrival to first scheduled, per class and tenant.", labels,
                                    buckets=REQUEST_LATENCY_BUCKETS, registry=registry)
        self.prompt_tokens = Counter(PREFIX + "class_prompt_tokens", "Prompt tokens served, per class and tenant.",
                                     labels, registry=registry)
        self.generation_tokens = Counter(PREFIX + "class_generation_tokens",
                                         "Generated tokens, per class and tenant.", labels, registry=registry)

    def _labels(self, hints: SchedulingHints) -> tuple[str, str, str]:
        return (self.model_name, str(priority_class(hints.priority, self.num_priority_classes)),
                self.tenant_label(hints.tenant))

    def record_first_token(self, output: RequestOutput, hints: SchedulingHints) -> None:
        self.prompt_tokens.labels(*self._labels(hints)).inc(len(output.prompt_token_ids))

    def record_new_tokens(self, num_tokens: int, hints: SchedulingHints) -> None:
        self.generation_tokens.labels(*self._labels(hints)).inc(num_tokens)

    def record_finished(self, output: RequestOutput, hints: SchedulingHints) -> None:
        labels = self._labels(hints)
        m = output.metrics
        if m.first_scheduled_time is not None:
            self.queue_time.labels(*labels).observe(m.first_scheduled_time - m.arrival_time)
        if hints.ttft_slo is not None:
            met = m.first_token_time is not None and m.first_token_time - m.arrival_time <= hints.ttft_slo
            self.ttft_slo.labels(*labels, "met" if met else "missed").inc()
        num_tokens = len(output.outputs[0].token_ids)
        if hints.tpot_slo is not None and (num_tokens > 1 or output.outputs[0].finish_reason == "abort"):
            # An aborted or shed request missed its TPOT whatever its pace; one with a single
            # token has none (as `bench serve` counts it) and is left out.
            met = (output.outputs[0].finish_reason != "abort" and m.finished_time is not None
                   and m.first_token_time is not None
                   and (m.finished_time - m.first_token_time) / (num_tokens - 1) <= hints.tpot_slo)
            self.tpot_slo.labels(*labels, "met" if met else "missed").inc()


class EngineMetrics:
    """The engine's Prometheus metrics, all labelled with `model_name`."""

    def __init__(self, model_name: str, max_num_batched_tokens: int, max_model_len: int,
                 registry: Optional[CollectorRegistry] = None, num_priority_classes: int = 4) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests running on the engine.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.num_requests_swapped = gauge("num_requests_swapped", "Requests swapped out to host memory.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.")
        self.num_requests_running_kv_int8 = gauge(
            "num_requests_running_kv_int8", "Running requests whose K/V are stored in int8 (low priority).")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self._num_preemptions = Counter(PREFIX + "num_preemptions", "Preemptions, by mode (recompute or swap).",
                                        ["model_name", "mode"], registry=self.registry)
        self.num_preemptions = {m: self._num_preemptions.labels(model_name, m) for m in PREEMPTION_KINDS}
        self.num_blocks_swapped_out = counter("num_blocks_swapped_out", "KV blocks copied to host memory.")
        self.num_blocks_swapped_in = counter("num_blocks_swapped_in", "KV blocks copied back from host memory.")
        self.cpu_cache_usage_perc = gauge("cpu_cache_usage_perc", "Swap space usage; 1 means 100 percent.")
        self.batch_max_num_batched_tokens = gauge(
            "batch_max_num_batched_tokens", "Token budget of the latest step (the batch controller's choice).")
        self.batch_max_num_seqs = gauge(
            "batch_max_num_seqs", "Running-sequence cap of the latest step (the batch controller's choice).")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests whose prefill completed.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self._request_success = Counter(
            PREFIX + "request_success", "Finished requests, by finish reason.",
            ["model_name", "finished_reason"], registry=self.registry)
        self.request_success = {r: self._request_success.labels(model_name, r) for r in FINISH_REASONS}
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time from arrival to the first token.", TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between consecutive outputs of a request.",
            TOKEN_LATENCY_BUCKETS)
        # vLLM's deprecated name for the inter-token latency (the same gaps), kept for the
        # dashboards that still read it; the per-request mean has a name of its own.
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds",
            "Time between consecutive outputs of a request (the same as inter_token_latency_seconds).",
            TOKEN_LATENCY_BUCKETS)
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Decode time per output token after the first, per finished request.", TOKEN_LATENCY_BUCKETS)
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Time from arrival to finish.", REQUEST_LATENCY_BUCKETS)
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Time from arrival to first scheduled.", REQUEST_LATENCY_BUCKETS)
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds", "Time from first scheduled to first token.",
            REQUEST_LATENCY_BUCKETS)
        self.request_decode_time = histogram(
            "request_decode_time_seconds", "Time from first token to finish.", REQUEST_LATENCY_BUCKETS)
        self.request_inference_time = histogram(
            "request_inference_time_seconds", "Time from first scheduled to finish.", REQUEST_LATENCY_BUCKETS)
        length_buckets = one_two_five_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per finished request.", length_buckets)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per finished request.", length_buckets)
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens computed per engine step.",
            iteration_token_buckets(max_num_batched_tokens))
        self.classes = ClassMetrics(self.registry, model_name, num_priority_classes)
        self._growth = CounterGrowth()

    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        """Gauges from a snapshot; counters by the growth of the scheduler's cumulative ones."""
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.num_requests_swapped.set(stats.num_swapped)
        self.kv_cache_usage_perc.set(stats.kv_cache_usage)
        self.num_requests_running_kv_int8.set(stats.num_running_kv_int8)
        self.cpu_cache_usage_perc.set(stats.swap_space_usage or 0.0)
        if stats.batch_limits is not None:
            self.batch_max_num_batched_tokens.set(stats.batch_limits.max_num_batched_tokens)
            self.batch_max_num_seqs.set(stats.batch_limits.max_num_seqs)
        growth = self._growth.take(queries=stats.prefix_cache.queries, hits=stats.prefix_cache.hits,
                                   swapped_out=stats.num_blocks_swapped_out, swapped_in=stats.num_blocks_swapped_in,
                                   **stats.num_preemptions_by_mode)
        self.prefix_cache_queries.inc(growth["queries"])
        self.prefix_cache_hits.inc(growth["hits"])
        self.num_blocks_swapped_out.inc(growth["swapped_out"])
        self.num_blocks_swapped_in.inc(growth["swapped_in"])
        for mode, counter in self.num_preemptions.items():
            counter.inc(growth.get(mode, 0))

    def record_iteration(self, num_scheduled_tokens: int) -> None:
        if num_scheduled_tokens > 0:
            self.iteration_tokens.observe(num_scheduled_tokens)

    def record_first_token(self, output: RequestOutput, hints: SchedulingHints = SchedulingHints()) -> None:
        m = output.metrics
        self.prompt_tokens.inc(len(output.prompt_token_ids))
        self.classes.record_first_token(output, hints)
        if m.first_token_time is not None:
            self.time_to_first_token.observe(m.first_token_time - m.arrival_time)

    def record_new_tokens(self, num_tokens: int, inter_token_latency: Optional[float],
                          hints: SchedulingHints = SchedulingHints()) -> None:
        self.generation_tokens.inc(num_tokens)
        self.classes.record_new_tokens(num_tokens, hints)
        if inter_token_latency is not None:
            self.inter_token_latency.observe(inter_token_latency)
            self.time_per_output_token.observe(inter_token_latency)

    def record_finished(self, output: RequestOutput, hints: SchedulingHints = SchedulingHints()) -> None:
        m = output.metrics
        completion = output.outputs[0]
        self.request_success[completion.finish_reason or "abort"].inc()
        self.classes.record_finished(output, hints)
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        self.request_generation_tokens.observe(len(completion.token_ids))
        if m.finished_time is None:
            return
        self.e2e_request_latency.observe(m.finished_time - m.arrival_time)
        if m.first_scheduled_time is None:
            return  # aborted while waiting: it never reached the model
        self.request_queue_time.observe(m.first_scheduled_time - m.arrival_time)
        self.request_inference_time.observe(m.finished_time - m.first_scheduled_time)
        if m.first_token_time is None:
            return
        self.request_prefill_time.observe(m.first_token_time - m.first_scheduled_time)
        decode_time = m.finished_time - m.first_token_time
        self.request_decode_time.observe(decode_time)
        num_tokens = len(completion.token_ids)
        if num_tokens > 1:
            self.request_time_per_output_token.observe(decode_time / (num_tokens - 1))


@dataclass
class _Window:
    start: float
    prompt_tokens: int = 0
    generation_tokens: int = 0


class StatsLogger:
    """The periodic one-line summary vLLM users know, every `interval_s` while there is work.

    Throughputs are averages over the interval; the prefix-cache hit rate is over the lookups
    made in the interval. Repeated idle lines are suppressed.
    """

    def __init__(self, interval_s: float, now: float) -> None:
        self.interval_s = interval_s
        self._window = _Window(now)
        self._growth = CounterGrowth()  # prefix-cache lookups, preemptions and copies since the last line
        self._logged_idle = False

    def add_tokens(self, prompt_tokens: int, generation_tokens: int) -> None:
        self._window.prompt_tokens += prompt_tokens
        self._window.generation_tokens += generation_tokens

    def maybe_log(self, stats: SchedulerStats, now: float) -> None:
        w = self._window
        elapsed = now - w.start
        if elapsed < self.interval_s:
            return
        idle = (w.prompt_tokens == 0 and w.generation_tokens == 0 and stats.num_running == 0
                and stats.num_waiting == 0 and stats.num_swapped == 0)
        growth = self._growth.take(queries=stats.prefix_cache.queries, hits=stats.prefix_cache.hits,
                                   swapped_out=stats.num_blocks_swapped_out, swapped_in=stats.num_blocks_swapped_in,
                                   **stats.num_preemptions_by_mode)
        queries, hits = growth["queries"], growth["hits"]
        if not (idle and self._logged_idle):
            line = ("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                    "Running: %d reqs, Waiting: %d reqs, Swapped: %d reqs, KV cache usage: %.1f%%, "
                    "Prefix cache hit rate: %.1f%%")
            args = [w.prompt_tokens / elapsed, w.generation_tokens / elapsed, stats.num_running,
                    stats.num_waiting, stats.num_swapped, 100 * stats.kv_cache_usage,
                    100 * hits / queries if queries > 0 else 0.0]
            if stats.swap_space_usage is not None:  # an engine with swap space: what it did in the interval
                line += (", Swap space usage: %.1f%%, Preemptions: %d recompute / %d swap, "
                         "Blocks swapped out/in: %d/%d")
                args += [100 * stats.swap_space_usage, growth.get("recompute", 0), growth.get("swap", 0),
                         growth["swapped_out"], growth["swapped_in"]]
            if stats.batch_controller != "static" and stats.batch_limits is not None:  # its decisions
                line += ", Batch limits (%s): %d tokens, %d seqs"
                args += [stats.batch_controller, stats.batch_limits.max_num_batched_tokens,
                         stats.batch_limits.max_num_seqs]
                if stats.batch_control.get("min_budget_over_target"):  # slo: the target cannot be met
                    line += " (min budget over the target)"
                knee = stats.batch_control.get("broken_num_seqs")
                if knee is not None:  # slo: the cap is held under a batch size that broke the target
                    line += " (knee at %d seqs)"
                    args.append(knee)
            logger.info(line, *args)
        self._logged_idle = idle
        self._window = _Window(now)

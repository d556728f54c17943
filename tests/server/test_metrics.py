"""/metrics moves by exactly what a known workload did; the periodic stats line."""

from __future__ import annotations

import asyncio
import logging
import math
import re

import pytest

from tests.server.conftest import BLOCK_SIZE, wait_until
from tests.server.helpers import MODEL, client, scrape, slow_down_steps, value
from tokenweir.config import EngineArgs
from tokenweir.core.kv_cache_manager import PrefixCacheStats
from tokenweir.core.scheduler import SchedulerStats
from tokenweir.engine.async_engine import AsyncLLMEngine
from tokenweir.engine.core import EngineCore
from tokenweir.metrics import StatsLogger
from tokenweir.request import SamplingParams

# One observation per finished request.
HISTOGRAMS = ["time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
              "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
              "request_time_per_output_token_seconds", "request_prompt_tokens", "request_generation_tokens"]
# One observation per gap between a request's outputs (vLLM keeps the second as a deprecated
# name of the first).
GAP_HISTOGRAMS = ["inter_token_latency_seconds", "time_per_output_token_seconds"]


# vLLM v0.11's bucket edges (vllm/v1/metrics/loggers.py, PrometheusStatLogger), written out
# here rather than imported so that a change on either side shows.
VLLM_BUCKETS = {
    "time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0],
    "inter_token_latency_seconds": [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                                    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0],
    "e2e_request_latency_seconds": [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0],
    "iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
    # build_1_2_5_buckets(max_model_len)
    "request_prompt_tokens": [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000,
                              100000, 200000, 500000, 1000000],
}


def delta(before, after, name, **labels):
    return value(after, name, **labels) - value(before, name, **labels)


def test_counters_and_histograms_after_a_known_workload(server, engine):
    # Prompts shorter than a block: no full block, so no prefix-cache hit can shorten a prefill.
    prompts = ["the a of", "hello world yes", "paris is the capital of france"]
    max_tokens = [3, 5, 7]
    prompt_lens = [len(engine.tokenizer.encode(p, add_special_tokens=True)) for p in prompts]
    assert max(prompt_lens) < BLOCK_SIZE
    c = client(server)
    before = scrape(server)
    for prompt, n in zip(prompts, max_tokens):
        c.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                             extra_body={"ignore_eos": True})
    after = scrape(server)

    assert delta(before, after, "tokenweir:prompt_tokens_total") == sum(prompt_lens)
    assert delta(before, after, "tokenweir:generation_tokens_total") == sum(max_tokens)
    assert delta(before, after, "tokenweir:request_success_total", finished_reason="length") == 3
    assert delta(before, after, "tokenweir:request_success_total", finished_reason="stop") == 0
    for name in HISTOGRAMS:
        assert delta(before, after, f"tokenweir:{name}_count") == 3, name
    # One inter-token gap per token after the first; each step computes a whole prompt or the
    # previous token (the last sampled token is never fed back).
    for name in GAP_HISTOGRAMS:
        assert delta(before, after, f"tokenweir:{name}_count") == sum(n - 1 for n in max_tokens), name
    assert delta(before, after, "tokenweir:inter_token_latency_seconds_sum") == pytest.approx(
        delta(before, after, "tokenweir:time_per_output_token_seconds_sum"))
    assert delta(before, after, "tokenweir:request_prompt_tokens_sum") == sum(prompt_lens)
    assert delta(before, after, "tokenweir:request_generation_tokens_sum") == sum(max_tokens)
    # Each request's mean gap: its decode time over its gaps, so the per-request histogram's
    # sum is the sum of those means, no more than the decode times' sum.
    assert 0 < delta(before, after, "tokenweir:request_time_per_output_token_seconds_sum") <= delta(
        before, after, "tokenweir:request_decode_time_seconds_sum")
    assert delta(before, after, "tokenweir:iteration_tokens_total_sum") == sum(prompt_lens) + sum(
        n - 1 for n in max_tokens)
    assert delta(before, after, "tokenweir:prefix_cache_queries_total") == sum(prompt_lens)
    assert delta(before, after, "tokenweir:prefix_cache_hits_total") == 0
    for mode in ("recompute", "swap"):
        assert ("tokenweir:num_preemptions_total", frozenset({"model_name": MODEL, "mode": mode}.items())) in after
        assert delta(before, after, "tokenweir:num_preemptions_total", mode=mode) == 0


def test_prefix_cache_hits_are_counted(server, engine):
    prompt = " ".join(["water than call first who may down side been now find"] * 4)
    n = len(engine.tokenizer.encode(prompt, add_special_tokens=True))
    c = client(server)
    before = scrape(server)
    for _ in range(2):
        c.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0,
                             extra_body={"ignore_eos": True})
    after = scrape(server)
    assert delta(before, after, "tokenweir:prefix_cache_queries_total") == 2 * n
    # The second request finds the first one's full blocks (at least one token is always computed).
    assert delta(before, after, "tokenweir:prefix_cache_hits_total") == (n - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_every_metric_is_exported_with_the_model_name(server):
    samples = scrape(server)
    names = {name for name, labels in samples if ("model_name", MODEL) in labels}
    for gauge in ["num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage_perc",
                  "cpu_cache_usage_perc"]:
        assert f"tokenweir:{gauge}" in names
    for counter in ["prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens",
                    "generation_tokens", "request_success", "num_blocks_swapped_out", "num_blocks_swapped_in"]:
        assert f"tokenweir:{counter}_total" in names
    for histogram in HISTOGRAMS + GAP_HISTOGRAMS + ["iteration_tokens_total"]:
        assert f"tokenweir:{histogram}_bucket" in names
    assert not any(name.endswith("_created") for name in names)


def bucket_edges(samples, histogram: str) -> list[float]:
    """The finite `le` edges of a histogram's buckets, ascending."""
    edges = [float(dict(labels)["le"]) for name, labels in samples if name == f"tokenweir:{histogram}_bucket"]
    return sorted(e for e in edges if not math.isinf(e))


@pytest.mark.parametrize("histogram", sorted(VLLM_BUCKETS))
def test_bucket_edges_are_vllms(server, engine, histogram):
    expected = VLLM_BUCKETS[histogram]
    if histogram == "iteration_tokens_total":
        # tokenweir drops the edges above its step budget, which no step can reach; vLLM keeps
        # all of them.
        budget = engine.core.scheduler_config.max_num_batched_tokens
        expected = [e for e in expected if e <= budget]
    if histogram == "request_prompt_tokens":  # vLLM's edges stop at max_model_len
        expected = [e for e in expected if e <= engine.model_info.max_model_len]
    assert bucket_edges(scrape(server), histogram) == expected


STATS_LINE = re.compile(
    r"Avg prompt throughput: (?P<prompt>[\d.]+) tokens/s, Avg generation throughput: (?P<gen>[\d.]+) tokens/s, "
    r"Running: (?P<running>\d+) reqs, Waiting: (?P<waiting>\d+) reqs, Swapped: (?P<swapped>\d+) reqs, "
    r"KV cache usage: (?P<kv>[\d.]+)%, Prefix cache hit rate: (?P<hit>[\d.]+)%$")
IDLE = {"prompt": "0.0", "gen": "0.0", "running": "0", "waiting": "0", "swapped": "0", "kv": "0.0", "hit": "0.0"}


def test_engine_logs_stats_lines_for_a_known_workload(tiny_model_dir, caplog, monkeypatch):
    # Three requests on a two-sequence engine whose steps take >= 30 ms, more than the 20 ms
    # log interval, so that every step ends with a line: while the first two run, the third
    # waits. The prompts share two full blocks, which a request admitted later finds cached.
    args = EngineArgs(model=tiny_model_dir("llama"), dtype="float32", device="cpu", num_gpu_blocks_override=64,
                      block_size=BLOCK_SIZE, max_num_seqs=2, served_model_name=MODEL)
    engine = AsyncLLMEngine(EngineCore(args), log_stats=True, stats_interval_s=0.02)
    slow_down_steps(engine.core, monkeypatch, 0.03)
    shared = list(range(5, 5 + 2 * BLOCK_SIZE))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    async def run(i):
        return [out async for out in engine.generate(f"r{i}", shared + [100 + i], params)]

    async def run_all():
        return await asyncio.gather(*(run(i) for i in range(3)))

    def lines():
        return [m.groupdict() for m in map(STATS_LINE.match, caplog.messages) if m]

    try:
        with caplog.at_level(logging.INFO, logger="tokenweir"):
            outputs = asyncio.run(run_all())
            # After the work, an idle line: the engine publishes stats while it waits.
            wait_until(lambda: lines()[-1:] == [IDLE], "the idle stats line", timeout_s=5)
    finally:
        engine.shutdown()

    assert all(out[-1].outputs[0].finish_reason == "length" for out in outputs)
    logged = lines()
    assert len(logged) == len([m for m in caplog.messages if "Avg prompt throughput" in m])  # all parse
    assert all(int(line["running"]) <= 2 and line["swapped"] == "0" for line in logged)
    busy = [line for line in logged if (line["running"], line["waiting"]) == ("2", "1")]
    assert busy and all(float(line["kv"]) > 0 for line in busy)
    assert any(float(line["prompt"]) > 0 for line in logged)
    assert any(float(line["gen"]) > 0 for line in logged)
    # A request admitted after another one's prefill hits the shared blocks: 32 of its 33
    # prompt tokens; the line of that step shows it.
    assert f"{100 * 2 * BLOCK_SIZE / (2 * BLOCK_SIZE + 1):.1f}" in [line["hit"] for line in logged]


def test_stats_log_line(caplog):
    def stats(running, waiting, usage, queries, hits):
        return SchedulerStats(num_running=running, num_waiting=waiting, num_swapped=0, kv_cache_usage=usage,
                              num_preemptions=0, prefix_cache=PrefixCacheStats(queries=queries, hits=hits))

    log = StatsLogger(interval_s=5.0, now=100.0)
    log.add_tokens(prompt_tokens=500, generation_tokens=100)
    with caplog.at_level(logging.INFO, logger="tokenweir"):
        log.maybe_log(stats(2, 1, 0.25, 200, 50), now=102.0)  # too early: nothing
        assert caplog.messages == []
        log.maybe_log(stats(2, 1, 0.25, 200, 50), now=110.0)
        log.maybe_log(stats(0, 0, 0.0, 200, 50), now=120.0)  # idle after work: one more line
        log.maybe_log(stats(0, 0, 0.0, 200, 50), now=130.0)  # still idle: suppressed
    assert caplog.messages == [
        "Avg prompt throughput: 50.0 tokens/s, Avg generation throughput: 10.0 tokens/s, Running: 2 reqs, "
        "Waiting: 1 reqs, Swapped: 0 reqs, KV cache usage: 25.0%, Prefix cache hit rate: 25.0%",
        "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, Running: 0 reqs, "
        "Waiting: 0 reqs, Swapped: 0 reqs, KV cache usage: 0.0%, Prefix cache hit rate: 0.0%",
    ]

"""/metrics moves by exactly what a known workload did; the periodic stats line."""

from __future__ import annotations

import logging

from tests.server.conftest import BLOCK_SIZE
from tests.server.helpers import MODEL, client, scrape, value
from tokenweir.core.kv_cache_manager import PrefixCacheStats
from tokenweir.core.scheduler import SchedulerStats
from tokenweir.metrics import StatsLogger

HISTOGRAMS = ["time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
              "request_prefill_time_seconds", "request_decode_time_seconds", "time_per_output_token_seconds"]


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
    assert delta(before, after, "tokenweir:inter_token_latency_seconds_count") == sum(n - 1 for n in max_tokens)
    assert delta(before, after, "tokenweir:iteration_tokens_total_sum") == sum(prompt_lens) + sum(
        n - 1 for n in max_tokens)
    assert delta(before, after, "tokenweir:prefix_cache_queries_total") == sum(prompt_lens)
    assert delta(before, after, "tokenweir:prefix_cache_hits_total") == 0
    assert delta(before, after, "tokenweir:num_preemptions_total") == 0


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
    for gauge in ["num_requests_running", "num_requests_waiting", "num_requests_swapped", "kv_cache_usage_perc"]:
        assert f"tokenweir:{gauge}" in names
    for counter in ["prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "prompt_tokens",
                    "generation_tokens", "request_success"]:
        assert f"tokenweir:{counter}_total" in names
    for histogram in HISTOGRAMS + ["inter_token_latency_seconds", "iteration_tokens_total"]:
        assert f"tokenweir:{histogram}_bucket" in names
    assert not any(name.endswith("_created") for name in names)


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

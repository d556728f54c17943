"""Two replicas on a local Ray, on the default model: routing policies side by side, and a
replica killed mid-run.

Routing (one fresh cluster per policy, same workload and order): 8 system prompts of 512 tokens,
each followed by its own 16-token question, 16 greedy tokens out, 64 requests (each system
prompt 8 times, in a seeded random order), 8 in flight at a time. Each replica's KV pool (136 MiB, 193 blocks of 16 bf16 tokens) holds the 8 system
prompts (256 blocks) only if each replica keeps about half of them: a router that spreads a
prompt's requests over both replicas makes each evict what the other half needs. Reported per
policy: prefix-cache hit rate (the replicas' counters), output throughput, TTFT p50/p99.

Failover (prefix_affinity): 16 greedy requests of 64 tokens, 8 in flight; the same requests run
once undisturbed, then again with the replica holding most requests SIGKILLed once every stream
has 8 tokens. Reported: requests finished, streams equal to the undisturbed run's token for
token, the longest gap between two tokens of any stream (the stall the failover cost), and the
time until the killed replica is serving again.

Machine-dependent wall times: compare policies within one run. Writes docs/benchmarks/cluster.md
and .json:

    .venv/bin/python benchmarks/cluster.py
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import signal
import statistics
import time
from pathlib import Path

from tokenweir import SamplingParams
from tokenweir.cluster.config import ClusterConfig
from tokenweir.cluster.coordinator import ClusterEngine
from tokenweir.config import EngineArgs
from tokenweir.machine import cpu_name
from tokenweir.model.loader import default_model_path

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
POLICIES = ("round_robin", "least_loaded", "prefix_affinity", "score")


def engine_args() -> EngineArgs:
    return EngineArgs(model=default_model_path(), kv_cache_memory="136MiB", max_model_len=1024,
                      disable_log_stats=True)


def routing_requests(seed: int) -> list[list[int]]:
    systems = [[100 + (seed * 7919 + s * 131 + j * 17) % 40000 for j in range(512)] for s in range(8)]
    order = [s for s in range(8) for _ in range(8)]  # every system prompt 8 times, in a seeded random order
    random.Random(seed).shuffle(order)
    return [systems[s] + [200 + (i * 37 + j) % 30000 for j in range(16)] for i, s in enumerate(order)]


async def run_closed_loop(engine: ClusterEngine, prompts: list[list[int]], params: SamplingParams,
                          concurrency: int, prefix: str, on_token=None) -> list[dict]:
    """Each prompt through the engine, `concurrency` at a time; per request its tokens, TTFT and
    the times its tokens arrived."""
    gate = asyncio.Semaphore(concurrency)
    results: list[dict] = [{} for _ in prompts]

    async def one(i: int) -> None:
        async with gate:
            start = time.monotonic()
            times: list[float] = []
            tokens: list[int] = []
            async for output in await engine.add_request(f"{prefix}{i}", prompts[i], params):
                new = output.outputs[0].token_ids[len(tokens):]
                now = time.monotonic()
                times.extend([now] * len(new))
                tokens.extend(new)
                if on_token is not None:
                    on_token(i, len(tokens))
            results[i] = {"tokens": tokens, "ttft": times[0] - start, "times": times}
    await asyncio.gather(*[one(i) for i in range(len(prompts))])
    return results


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def bench_routing(policy: str) -> dict:
    engine = ClusterEngine(engine_args(), ClusterConfig(data_parallel_size=2, routing_policy=policy))
    try:
        params = SamplingParams(max_tokens=16, min_tokens=16, temperature=0.0)
        asyncio.run(run_closed_loop(engine, routing_requests(seed=99)[:2], params, 2, "warm"))  # load the kernels
        before = engine.get_stats().prefix_cache
        prompts = routing_requests(seed=1)
        start = time.monotonic()
        results = asyncio.run(run_closed_loop(engine, prompts, params, 8, "r"))
        elapsed = time.monotonic() - start
        after = engine.get_stats().prefix_cache
        served = [s.prefix_cache.requests for s in engine.replica_stats()]
    finally:
        engine.shutdown()
    ttfts = [r["ttft"] for r in results]
    return {"policy": policy, "requests": len(prompts), "seconds": elapsed,
            "prefix_hit_rate": (after.hits - before.hits) / (after.queries - before.queries),
            "output_tokens_per_s": sum(len(r["tokens"]) for r in results) / elapsed,
            "ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": percentile(ttfts, 99),
            "requests_per_replica_incl_warmup": served}


def simulate_routing(policy: str) -> dict:
    """The same workload on the simulated cluster (the shipped CPU profile), for the hit rate:
    the router's decisions are the coordinator's code; step times are the profile's."""
    from tokenweir.core.cost_model import load_cost_model
    from tokenweir.sim.cluster import ClusterSimulator
    from tokenweir.sim.simulator import SimRequest

    prompts = routing_requests(seed=1)
    sim = ClusterSimulator.from_engine_args(dataclasses.replace(engine_args(), model=None), ClusterConfig(
        data_parallel_size=2, routing_policy=policy), load_cost_model(None))
    result = sim.run([SimRequest(f"r{i}", p, 16, 0.0) for i, p in enumerate(prompts)], max_concurrency=8)
    stats = [s.kv_cache_manager.prefix_cache_stats for s in sim.schedulers]
    return {"policy": policy, "prefix_hit_rate": sum(s.hits for s in stats) / sum(s.queries for s in stats),
            "output_tokens_per_s": sum(r.output_tokens for r in result.records) / result.duration_s}


def bench_failover() -> dict:
    engine = ClusterEngine(engine_args(), ClusterConfig(data_parallel_size=2, routing_policy="prefix_affinity"))
    try:
        params = SamplingParams(max_tokens=64, min_tokens=64, temperature=0.0)
        prompts = [[300 + (i * 53 + j * 11) % 30000 for j in range(40 + 8 * i)] for i in range(16)]
        asyncio.run(run_closed_loop(engine, prompts[:2], params, 2, "warm"))
        undisturbed = asyncio.run(run_closed_loop(engine, prompts, params, 8, "u"))
        killed: dict = {}

        def on_token(i: int, n: int) -> None:
            progress[i] = n
            live = [p for p in progress.values()]
            if not killed and len(live) >= 8 and min(live) >= 8:
                counts, pids = engine.replica_num_requests(), engine.replica_pids()
                busiest = max(range(len(counts)), key=counts.__getitem__)
                killed.update(pid=pids[busiest], index=busiest, held=counts[busiest], at=time.monotonic())
                os.kill(pids[busiest], signal.SIGKILL)

        progress: dict[int, int] = {}
        disturbed = asyncio.run(run_closed_loop(engine, prompts, params, 8, "f", on_token))
        while None in engine.replica_pids():
            time.sleep(0.1)
        restarted_after = time.monotonic() - killed["at"]
    finally:
        engine.shutdown()
    gaps = [b - a for r in disturbed for a, b in zip(r["times"], r["times"][1:])]
    normal_gaps = [b - a for r in undisturbed for a, b in zip(r["times"], r["times"][1:])]
    return {"requests": len(prompts), "finished": sum(1 for r in disturbed if len(r["tokens"]) == 64),
            "streams_equal_to_undisturbed": sum(1 for a, b in zip(disturbed, undisturbed) if a["tokens"] == b["tokens"]),
            "requests_on_killed_replica": killed["held"],
            "longest_token_gap_s": max(gaps), "longest_token_gap_undisturbed_s": max(normal_gaps),
            "replica_serving_again_after_s": restarted_after}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policies", default=",".join(POLICIES))
    ns = parser.parse_args()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    routing = [bench_routing(p) for p in ns.policies.split(",")]
    simulated = [simulate_routing(p) for p in ns.policies.split(",")]
    failover = bench_failover()
    result = {"machine": cpu_name(), "cores": os.cpu_count(), "date": started,
              "command": "python benchmarks/cluster.py", "routing": routing,
              "routing_simulated": {"profile": "(shipped) smollm2-135m-cpu.json", "runs": simulated},
              "failover": failover}
    (OUT / "cluster.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# Multi-replica serving: routing and failover (real engine)", "",
        f"Two replicas of the default model (bf16, 1 torch thread each) on a local Ray, {result['machine']}, "
        f"{result['cores']} cores, {started}. Command: `{result['command']}`; the workloads are in its docstring.",
        "", "## Routing: a shared-prefix workload under cache pressure", "",
        "| policy | prefix hit rate | output tok/s | TTFT p50 (s) | TTFT p99 (s) | wall (s) | requests per replica |",
        "|---|---|---|---|---|---|---|"]
    for r in routing:
        lines.append(f"| {r['policy']} | {r['prefix_hit_rate']:.1%} | {r['output_tokens_per_s']:.1f} | "
                     f"{r['ttft_p50_s']:.2f} | {r['ttft_p99_s']:.2f} | {r['seconds']:.1f} | "
                     f"{r['requests_per_replica_incl_warmup']} |")
    by_name = {r["policy"]: r for r in routing}
    if "round_robin" in by_name:
        base = by_name["round_robin"]
        lines += ["", "Against round_robin in this run: " + "; ".join(
            f"{r['policy']} hit rate {100 * (r['prefix_hit_rate'] - base['prefix_hit_rate']):+.1f} points, "
            f"throughput {r['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}x, "
            f"TTFT p99 {r['ttft_p99_s'] / base['ttft_p99_s']:.2f}x" for r in routing if r is not base) + ".",
            "The most a router could reach here: every request after the first of its system prompt "
            f"hitting its 512 tokens, {56 * 512 / (64 * 528):.1%} of the prompt tokens."]
    lines += ["", "SIMULATED, the same workload on `tokenweir simulate`'s cluster (the shipped CPU profile: its "
              "step times are of one engine with the machine's 2 threads, so only the hit rates compare):", "",
              "| policy | prefix hit rate (simulated) | (real, above) | output tok/s (simulated) |", "|---|---|---|---|"]
    for sim, real in zip(simulated, routing):
        lines.append(f"| {sim['policy']} | {sim['prefix_hit_rate']:.1%} | {real['prefix_hit_rate']:.1%} | "
                     f"{sim['output_tokens_per_s']:.1f} |")
    f = failover
    lines += ["", "## Failover: a replica SIGKILLed mid-run", "",
              f"- {f['finished']} of {f['requests']} requests finished; {f['streams_equal_to_undisturbed']} streams "
              f"equal to the undisturbed run's, token for token ({f['requests_on_killed_replica']} were on the "
              "killed replica).",
              f"- Longest gap between two tokens of a stream: {f['longest_token_gap_s']:.2f} s "
              f"(undisturbed run: {f['longest_token_gap_undisturbed_s']:.2f} s).",
              f"- The killed replica served again after {f['replica_serving_again_after_s']:.1f} s "
              "(a new actor process loading the model).", ""]
    (OUT / "cluster.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

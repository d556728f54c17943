"""Int8 K/V for low-priority requests (`--low-priority-kv-cache-dtype int8`) on the default model.

Three measurements, each side by side in one process (the same loaded weights, two engines):

1. Accuracy. Greedy continuations of chat prompts (short questions, and questions over a
   ~1,500-token document from this repository's docs) with every request int8 against the
   model's dtype: how many continuations are identical, how many tokens agree before the first
   difference, and the largest change of the sampled token's logprob while they agree (the
   contexts are then the same, so the two logprobs are of one token in one context).
2. Capacity. A fixed KV pool and 16 requests of ~400 + 128 tokens, half of them low priority:
   preemptions, the most requests in one step, total time and the high-priority requests' mean
   latency, with and without int8 for the low-priority half (rounds alternate the order); and the
   same requests SIMULATED (the real scheduler on the shipped CPU profile), whose preemptions and
   batch sizes should be the engine's own.
3. The attention kernel alone: one layer's decode attention over 32 rows x 1,024 context tokens
   (SmolLM2's 9 query / 3 KV heads of 64), all rows bf16 against all rows int8.
4. The scheduler's CPU per step (benchmarks/scheduler_overhead.py's churn case: 256 running,
   10,000 waiting, requests finishing and admitted every step) without and with int8 for half.

Writes docs/benchmarks/kv_int8.md and .json.

    .venv/bin/python benchmarks/kv_int8.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from tokenweir import SamplingParams
from tokenweir.config import EngineArgs
from tokenweir.core.cost_model import load_cost_model
from tokenweir.engine.core import EngineCore
from tokenweir.machine import cpu_name
from tokenweir.model.attention import (AttentionMetadata, allocate_kv_caches, int8_block_size, paged_attention,
                                       write_kv)
from tokenweir.model.loader import load_model
from tokenweir.request import SchedulingHints
from tokenweir.sim.simulator import SimRequest, Simulator

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scheduler benchmark's churn case
from scheduler_overhead import measure_churn  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks"
QUESTIONS = [
    "What is the capital of France?", "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.", "How do I reverse a list in Python?",
    "What causes the seasons on Earth?", "Give three tips for a job interview.",
    "What is the difference between weather and climate?", "Summarize the plot of Romeo and Juliet.",
    "Why is the sky blue?", "List five fruits that are high in vitamin C.",
    "What does a CPU cache do?", "How many legs does a spider have, and why?",
    "Translate 'good morning' into Spanish and French.", "What is a prime number? Give examples.",
    "Describe how a bicycle works.", "What should I pack for a weekend hiking trip?",
]
DOC_QUESTIONS = ["What is this document about?", "Which parts does the text name?",
                 "Summarize the text in three sentences.", "What problem does the design solve?"]


def chat(tokenizer, text: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def run(engine: EngineCore, prompts: list[list[int]], params: SamplingParams, priorities: list[int]) -> dict:
    start = time.perf_counter()
    for i, (prompt, priority) in enumerate(zip(prompts, priorities)):
        engine.add_request(f"r{i}", prompt, params, SchedulingHints(priority=priority))
    outputs, finished_at, most_running = {}, {}, 0
    while engine.has_unfinished_requests():
        result = engine.step()
        most_running = max(most_running, len(result.scheduler_output.num_scheduled_tokens))
        for out in result.outputs:
            if out.finished:
                outputs[out.request_id] = out.outputs[0]
                finished_at[out.request_id] = time.perf_counter() - start
    elapsed = time.perf_counter() - start
    ids = [f"r{i}" for i in range(len(prompts))]
    return {"outputs": [outputs[r] for r in ids], "finished_at": [finished_at[r] for r in ids],
            "seconds": elapsed, "most_running": most_running,
            "preemptions": engine.get_stats().num_preemptions}


def agreement(plain, int8) -> dict:
    same = 0
    while same < min(len(plain.token_ids), len(int8.token_ids)) and plain.token_ids[same] == int8.token_ids[same]:
        same += 1
    deltas = [abs(plain.logprobs[i][plain.token_ids[i]] - int8.logprobs[i][int8.token_ids[i]]) for i in range(same)]
    return {"identical": plain.token_ids == int8.token_ids, "agreeing_tokens": same,
            "tokens": len(plain.token_ids), "max_logprob_delta": max(deltas, default=0.0),
            "mean_logprob_delta": statistics.fmean(deltas) if deltas else 0.0}


# What each accuracy row compares: (engine, priority) against (engine, priority). The first is
# the noise floor: the same K/V dtype, another batch shape (one request at a time), which moves
# greedy continuations by itself (bf16 matmuls round differently for another number of rows).
COMPARISONS = {"model dtype: batched vs one at a time (noise floor)": (("plain", 0), ("serial", 0)),
               "int8 vs model dtype, both batched": (("int8", 1), ("plain", 0))}


def accuracy(loaded, max_tokens: int) -> dict:
    tokenizer = loaded.tokenizer
    document = (ROOT / "docs" / "architecture.md").read_text()[:6000]
    sets = {"short questions": [chat(tokenizer, q) for q in QUESTIONS],
            "questions over a document": [chat(tokenizer, f"{document}\n\n{q}") for q in DOC_QUESTIONS]}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    engines = {"plain": EngineCore(EngineArgs(kv_cache_memory="256MiB"), loaded),
               "serial": EngineCore(EngineArgs(kv_cache_memory="256MiB", max_num_seqs=1), loaded),
               "int8": EngineCore(EngineArgs(kv_cache_memory="256MiB", low_priority_kv_cache_dtype="int8"), loaded)}
    results: dict[str, dict] = {}
    for set_name, prompts in sets.items():
        outputs = {}
        for key in {side for pair in COMPARISONS.values() for side in pair}:
            engine, priority = key
            outputs[key] = run(engines[engine], prompts, params, [priority] * len(prompts))["outputs"]
        for comparison, (a, b) in COMPARISONS.items():
            rows = [agreement(x, y) for x, y in zip(outputs[a], outputs[b])]
            results.setdefault(comparison, {})[set_name] = {
                "prompts": len(prompts), "mean_prompt_tokens": round(statistics.fmean(map(len, prompts))),
                "identical": sum(r["identical"] for r in rows),
                "mean_agreeing_tokens": round(statistics.fmean(r["agreeing_tokens"] for r in rows), 1),
                "min_agreeing_tokens": min(r["agreeing_tokens"] for r in rows),
                "max_logprob_delta": round(max(r["max_logprob_delta"] for r in rows), 4),
                "mean_logprob_delta": round(statistics.fmean(r["mean_logprob_delta"] for r in rows), 5),
                "tokens": max_tokens}
            print(loaded.dtype, comparison, set_name, results[comparison][set_name], flush=True)
    return results


def capacity(loaded, rounds: int, num_blocks: int) -> dict:
    words = (ROOT / "docs" / "architecture.md").read_text().split()
    prompts = [loaded.tokenizer.encode(" ".join(words[200 * i: 200 * i + 300]))[:400] for i in range(16)]
    priorities = [i % 2 for i in range(16)]
    params = SamplingParams(max_tokens=128, min_tokens=128, temperature=0.0)
    configs = {"model dtype for all": {}, "int8 for priority >= 1": {"low_priority_kv_cache_dtype": "int8"}}
    by_config: dict[str, list[dict]] = {name: [] for name in configs}
    for r in range(rounds):
        order = list(configs) if r % 2 == 0 else list(reversed(configs))
        for name in order:
            engine = EngineCore(EngineArgs(num_gpu_blocks_override=num_blocks, **configs[name]), loaded)
            result = run(engine, prompts, params, priorities)
            high = [t for t, p in zip(result["finished_at"], priorities) if p == 0]
            by_config[name].append({"seconds": round(result["seconds"], 2), "preemptions": result["preemptions"],
                                    "most_running": result["most_running"],
                                    "high_priority_mean_latency_s": round(statistics.fmean(high), 2)})
            print(r, name, by_config[name][-1], flush=True)
    simulated = {name: simulate(EngineArgs(num_gpu_blocks_override=num_blocks, **config), prompts, priorities)
                 for name, config in configs.items()}
    return {"num_blocks": num_blocks, "block_size": 16, "requests": 16,
            "mean_prompt_tokens": round(statistics.fmean(map(len, prompts))), "output_tokens": 128,
            "rounds": by_config, "simulated": simulated}


def simulate(args: EngineArgs, prompts: list[list[int]], priorities: list[int]) -> dict:
    """The same requests through the real scheduler in the simulator (the shipped CPU profile):
    its KV accounting should make the very decisions the engine made."""
    most = [0]

    def on_step(out, _t: float) -> None:
        most[0] = max(most[0], len(out.num_scheduled_tokens))

    sim = Simulator.from_engine_args(args, load_cost_model(None), on_step=on_step)
    result = sim.run([SimRequest(f"r{i}", prompt, 128, 0.0, hints=SchedulingHints(priority=priority))
                      for i, (prompt, priority) in enumerate(zip(prompts, priorities))])
    return {"seconds": round(result.duration_s, 2), "preemptions": result.num_preemptions, "most_running": most[0]}


def kernel(repeats: int) -> dict:
    """Best of `repeats` calls of each, the two alternating (the machine's speed drifts), each on
    a cache of its own filled through the engine's write path."""
    rows, context, heads, kv_heads, head_dim, block_size = 32, 1024, 9, 3, 64, 16
    ibs = int8_block_size(block_size, head_dim, torch.bfloat16)
    torch.manual_seed(0)
    q = torch.randn(rows, heads, head_dim).to(torch.bfloat16)
    new_kv = torch.randn(rows, kv_heads, head_dim).to(torch.bfloat16)
    calls = {}
    for name, int8, per_row in (("bf16", False, -(-context // block_size)), ("int8", True, -(-context // ibs))):
        cache = allocate_kv_caches(_Arch(kv_heads, head_dim), rows * per_row, block_size, torch.bfloat16, "cpu")[0]
        tables = [list(range(r * per_row, (r + 1) * per_row)) for r in range(rows)]
        fill = AttentionMetadata.build([context] * rows, [context] * rows, tables, block_size,
                                       int8_rows=[int8] * rows, int8_block_size=ibs)
        k = torch.randn(rows * context, kv_heads, head_dim).to(torch.bfloat16)
        write_kv(cache, k, torch.randn_like(k), fill.slot_mapping, int8_slot_mapping=fill.int8_slot_mapping,
                 int8_block_size=ibs)
        meta = AttentionMetadata.build([1] * rows, [context] * rows, tables, block_size,
                                       int8_rows=[int8] * rows, int8_block_size=ibs)
        calls[name] = (lambda cache=cache, meta=meta: paged_attention(q, new_kv, new_kv, cache, meta))
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(repeats + 1):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            best[name] = min(best[name], time.perf_counter() - start)
    results = {name: round(1000 * seconds, 3) for name, seconds in best.items()}
    print("kernel", results, flush=True)
    return {"rows": rows, "context": context, "ms": results, "int8_block_size": ibs, "repeats": repeats}


def scheduler(rounds: int, steps: int) -> dict:
    times: dict[str, list[float]] = {"model dtype for all": [], "int8 for half": []}
    for _ in range(rounds):
        for name, int8 in (("model dtype for all", False), ("int8 for half", True)):
            times[name].append(measure_churn(256, 10_000, steps, int8_kv=int8)["cpu_ms_per_step"])
            print("scheduler", name, times[name][-1], "ms", flush=True)
    return {"running": 256, "waiting": 10_000, "steps": steps, "cpu_ms_per_step": times}


class _Arch:
    """The slice of ModelArchConfig that allocate_kv_caches reads: one layer."""

    def __init__(self, kv_heads: int, head_dim: int) -> None:
        self.num_key_value_heads, self.head_dim, self.num_hidden_layers = kv_heads, head_dim, 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-blocks", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=200)
    ns = parser.parse_args()
    loaded = load_model(None, "auto", "auto")
    measured_at = time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())
    data = {"machine": f"{cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads",
            "measured_at": measured_at, "model": loaded.name, "dtype": str(loaded.dtype).removeprefix("torch."),
            "command": " ".join(["python", "benchmarks/kv_int8.py", *sys.argv[1:]]), "kernel": kernel(ns.repeats),
            "scheduler": scheduler(3, 1000),
            "accuracy": accuracy(loaded, ns.max_tokens),
            "accuracy_float32": accuracy(load_model(None, "float32", "cpu"), ns.max_tokens),
            "capacity": capacity(loaded, ns.rounds, ns.num_blocks)}
    (OUT / "kv_int8.json").write_text(json.dumps(data, indent=2) + "\n")
    (OUT / "kv_int8.md").write_text(report(data))


def report(data: dict) -> str:
    k, cap = data["kernel"], data["capacity"]
    lines = ["# Int8 K/V for low-priority requests", "",
             f"`{data['command']}` on {data['model']} ({data['dtype']}). Machine: {data['machine']} (shared: "
             f"single runs carry noise), {data['measured_at']}. Data: [kv_int8.json](kv_int8.json).", "",
             "## Accuracy (greedy continuations, int8 K/V against the model's dtype)", "",
             "Tokens agreeing: up to the first difference. Logprob change: of the sampled token, over those "
             "agreeing tokens (one token in one context on both sides).", ""]
    for key, dtype in (("accuracy", data["dtype"]), ("accuracy_float32", "float32")):
        lines += [f"### Weights and activations in {dtype}", "",
                  "| comparison | prompts | n | mean prompt tokens | identical continuations | mean tokens agreeing "
                  "| fewest | largest logprob change while agreeing | mean |", "|---|---|---|---|---|---|---|---|---|"]
        for comparison, by_set in data[key].items():
            for name, r in by_set.items():
                lines.append(f"| {comparison} | {name} | {r['prompts']} | {r['mean_prompt_tokens']} | "
                             f"{r['identical']} / {r['prompts']} | {r['mean_agreeing_tokens']} of {r['tokens']} | "
                             f"{r['min_agreeing_tokens']} | {r['max_logprob_delta']} | {r['mean_logprob_delta']} |")
        lines.append("")
    lines += [f"## Capacity ({cap['requests']} requests of ~{cap['mean_prompt_tokens']} + {cap['output_tokens']} "
              f"tokens, half priority 1, a pool of {cap['num_blocks']} blocks of {cap['block_size']})", "",
              "| configuration | round | seconds | preemptions | most requests in a step | high-priority mean latency (s) |",
              "|---|---|---|---|---|---|"]
    for name, rounds in cap["rounds"].items():
        for i, r in enumerate(rounds):
            lines.append(f"| {name} | {i + 1} | {r['seconds']} | {r['preemptions']} | {r['most_running']} | "
                         f"{r['high_priority_mean_latency_s']} |")
    for name, r in cap["simulated"].items():
        lines.append(f"| {name}, SIMULATED (shipped CPU profile) | - | {r['seconds']} | {r['preemptions']} | "
                     f"{r['most_running']} | - |")
    lines += ["", f"## Attention kernel (one layer, {k['rows']} decode rows x {k['context']} context tokens)", "",
              f"bf16 rows: {k['ms']['bf16']} ms; int8 rows: {k['ms']['int8']} ms (ratio "
              f"{k['ms']['int8'] / k['ms']['bf16']:.2f}); an int8 block holds {k['int8_block_size']} tokens "
              "where a bf16 block holds 16."]
    seconds = {name: statistics.median(r["seconds"] for r in rounds) for name, rounds in cap["rounds"].items()}
    plain, int8 = seconds["model dtype for all"], seconds["int8 for priority >= 1"]
    comparison = "int8 vs model dtype, both batched"
    moved = {dtype: [r["mean_logprob_delta"] for r in data[key][comparison].values()]
             for key, dtype in (("accuracy", data["dtype"]), ("accuracy_float32", "float32"))}
    agreeing = {dtype: [r["mean_agreeing_tokens"] for r in data[key][comparison].values()]
                for key, dtype in (("accuracy", data["dtype"]), ("accuracy_float32", "float32"))}
    lines += ["", "Reading: where the noise-floor rows are identical (greedy output that does not depend on the "
              "batch), every difference in the int8 rows is the quantisation's. Int8 moves this 135M model's "
              "sampled-token logprobs by " + " and ".join(f"{min(v):.3f}-{max(v):.3f} nats on average in {d}"
                                                        for d, v in moved.items())
              + ", and its greedy continuations agree for " + " and ".join(
                  f"{min(v):.0f}-{max(v):.0f} tokens on average in {d}" for d, v in agreeing.items())
              + f" (of {data['accuracy'][comparison]['short questions']['tokens']}): the price the low-priority "
              f"requests pay. With the pool tight, the run took {int8 / plain:.2f}x the time (medians "
              f"{int8:.2f} s and {plain:.2f} s): more requests fit at once, fewer are preempted. " + (
                  "The simulator, driving the same scheduler on the shipped profile (another machine's step "
                  "times), makes the engine's decisions: the same preemptions and batch sizes."
                  if all(sim["preemptions"] == r["preemptions"] and sim["most_running"] == r["most_running"]
                         for name, sim in cap["simulated"].items() for r in cap["rounds"][name])
                  else "The simulator's preemptions or batch sizes differ from the engine's (table).")]
    sched = data["scheduler"]
    lines += ["", f"## Scheduler CPU per step ({sched['running']} running + {sched['waiting']:,} waiting, churn, "
              f"{sched['steps']} steps, rounds interleaved)", ""]
    for name, times in sched["cpu_ms_per_step"].items():
        lines.append(f"- {name}: median {statistics.median(times):.3f} ms ({' / '.join(f'{t:.3f}' for t in times)})")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

"""Offline throughput on the default model: tokenweir vs transformers, side by side in one run.

Workloads: N requests whose prompt/output lengths are sampled (seeded) from the Azure LLM
inference trace 2023 (conversation; Azure/AzurePublicDataset, CC-BY 4.0), under one or more
pairs of length caps (a prompt-heavy and a decode-heavy shape by default). Prompts are random token ids of exactly those lengths; EOS is ignored
so every request produces exactly its output length ("useful tokens").

Systems, all bf16 (or --dtype), each in its own fresh Python process:
  - tokenweir `LLM.generate` (continuous batching, paged KV)
  - transformers static batching: `generate` on left-padded batches of --static-batch, each batch
    running to its longest output (tokens past a request's own length are not useful)
  - optionally (`hf_static_tuned`) the static batch with the same malloc tuning tokenweir's engine
    applies to itself
  - transformers continuous batching (`init_continuous_batching` manager, per-request lengths)

Writes docs/benchmarks/offline_throughput.md and .json.

    .venv/bin/python benchmarks/offline_throughput.py [--workloads 512:128,64:128] [--systems tokenweir,hf_static,hf_cb]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT.parent / "shared" / "data" / "azure_llm_2023_conv.csv"
OUT = ROOT / "docs" / "benchmarks"


def sample_workload(n: int, max_prompt: int, max_output: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    with open(TRACE) as f:
        rows = [(int(r["num_prefill_tokens"]), int(r["num_decode_tokens"])) for r in csv.DictReader(f)]
    rng = random.Random(seed)
    picked = rng.sample(rows, n)
    # Token ids above the special tokens (SmolLM2 keeps its specials in the first few ids).
    return [([rng.randrange(100, vocab) for _ in range(min(p, max_prompt))], max(1, min(o, max_output)))
            for p, o in picked]


def run_tokenweir(workload, dtype: str, args) -> dict:
    from tokenweir import LLM, SamplingParams

    llm = LLM(None, dtype=dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens)
    warm = [{"prompt_token_ids": workload[0][0][:32]}]
    llm.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    prompts = [{"prompt_token_ids": p} for p, _ in workload]
    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for _, o in workload]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    useful = sum(len(o.outputs[0].token_ids) for o in outs)
    assert useful == sum(o for _, o in workload)
    stats = llm.get_stats()
    return {"seconds": elapsed, "useful_tokens": useful, "num_preemptions": stats.num_preemptions}


# Parts of a step -> the cProfile entries (file suffix, function name or a part of a built-in's
# name) whose own time they are.
_PARTS = {
    "matmuls (prepacked oneDNN linears, LM head)": [("~", "_linear_pointwise"), ("~", "_nn.linear")],
    "attention (C kernel)": [("kernels/__init__.py", "paged_attention")],
    "K/V cache writes (C)": [("kernels/__init__.py", "write_kv_cache")],
    "RMSNorm, SwiGLU, RoPE (C)": [("kernels/__init__.py", "rms_norm"), ("kernels/__init__.py", "silu_and_mul"),
                                  ("kernels/__init__.py", "rope_")],
    "sampling (argmax over the vocabulary)": [("kernels/__init__.py", "argmax_rows"), ("~", "argmax")],
}


def profile_tokenweir(workload, dtype: str, args, spec: str) -> None:
    """Run LLM.generate under cProfile, timing prefill-carrying and decode-only steps apart."""
    import cProfile
    import pstats

    from tokenweir import LLM, SamplingParams

    llm = LLM(None, dtype=dtype, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    engine = llm.engine
    llm.generate([{"prompt_token_ids": workload[0][0][:32]}], SamplingParams(max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    step_times = {"prefill": [0.0, 0], "decode": [0.0, 0]}
    step = engine.step

    def timed_step():
        start = time.perf_counter()
        out = step()
        kind = "prefill" if any(n > 1 for n in out.scheduler_output.num_scheduled_tokens.values()) else "decode"
        step_times[kind][0] += time.perf_counter() - start
        step_times[kind][1] += 1
        return out

    engine.step = timed_step
    prompts = [{"prompt_token_ids": p} for p, _ in workload]
    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for _, o in workload]
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.runcall(llm.generate, prompts, params, use_tqdm=False)
    total = time.perf_counter() - start
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (cc, nc, tottime, cumtime, callers)
    print(f"\n[{spec}] {total:.1f} s under the profiler; steps with prefill: {step_times['prefill'][1]} "
          f"({step_times['prefill'][0]:.1f} s), decode-only: {step_times['decode'][1]} ({step_times['decode'][0]:.1f} s)")
    accounted = 0.0
    for part, names in _PARTS.items():
        seconds = sum(v[2] for (file, _, name), v in stats.items()
                      if any(file.endswith(f) and (name == n or (f == "~" and n in name)) for f, n in names))
        accounted += seconds
        print(f"  {part:48s} {seconds:6.2f} s  {100 * seconds / total:4.1f}%")
    rest = total - accounted
    print(f"  {'everything else (Python, scheduler, detokenization)':48s} {rest:6.2f} s  {100 * rest / total:4.1f}%")


def _hf_model(dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    from tokenweir.model.gguf_conversion import ensure_hf_folder
    from tokenweir.model.loader import default_model_path

    return AutoModelForCausalLM.from_pretrained(ensure_hf_folder(default_model_path()), dtype=dtype).eval()


def run_hf_static(workload, dtype: torch.dtype, batch_size: int) -> dict:
    model = _hf_model(dtype)
    pad = 2
    useful = 0
    start = None
    # Warm-up on a small batch, outside the timed region.
    with torch.no_grad():
        model.generate(torch.tensor([workload[0][0][:16]]), max_new_tokens=2, do_sample=False, pad_token_id=pad)
        start = time.perf_counter()
        for i in range(0, len(workload), batch_size):
            batch = workload[i:i + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
            longest = max(o for _, o in batch)
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=longest,
                           min_new_tokens=longest, pad_token_id=pad)
            useful += sum(o for _, o in batch)
    return {"seconds": time.perf_counter() - start, "useful_tokens": useful}


def run_hf_continuous(workload, dtype: torch.dtype) -> dict:
    from transformers import GenerationConfig

    model = _hf_model(dtype)
    config = GenerationConfig(do_sample=False, max_new_tokens=max(o for _, o in workload), eos_token_id=None,
                              pad_token_id=2)
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    try:
        start = time.perf_counter()
        for i, (prompt, out_len) in enumerate(workload):
            manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=out_len)
        useful = 0
        for _ in workload:
            result = manager.get_result(timeout=600)
            useful += len(result.generated_tokens)
        elapsed = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    return {"seconds": elapsed, "useful_tokens": useful}


# glibc's environment form of what tokenweir's engine sets with mallopt (engine/cpu_allocator.py).
_TUNED_MALLOC = "GLIBC_TUNABLES=glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824"


def run_in_child(system: str, spec: str, args) -> dict:
    """Each system runs in a fresh interpreter: no allocator state, thread pool or setting of
    one system (tokenweir tunes malloc process-wide) carries over to the next."""
    forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                 if k not in ("one", "profile", "systems", "workloads")]
    env = dict(os.environ)
    if system == "hf_static_tuned":
        env.update([_TUNED_MALLOC.split("=", 1)])
    proc = subprocess.run([sys.executable, __file__, *forwarded, "--one", f"{system}@{spec}"], env=env,
                          capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{system} on {spec} failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--workloads", default="512:128,64:128",
                        help="comma-separated MAX_PROMPT:MAX_OUTPUT length caps, one run of every system each")
    parser.add_argument("--static-batch", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--systems", default="tokenweir,hf_static,hf_cb")
    parser.add_argument("--profile", action="store_true",
                        help="instead: run tokenweir on each workload under cProfile and print where the time goes")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # SYSTEM@MAX_PROMPT:MAX_OUTPUT, in a child process
    args = parser.parse_args()
    if args.one:
        system, spec = args.one.split("@")
        max_prompt, max_output = (int(x) for x in spec.split(":"))
        workload = sample_workload(args.num_requests, max_prompt, max_output, 49152, args.seed)
        torch_dtype = getattr(torch, args.dtype)
        run = {"tokenweir": lambda: run_tokenweir(workload, args.dtype, args),
               "hf_static": lambda: run_hf_static(workload, torch_dtype, args.static_batch),
               "hf_static_tuned": lambda: run_hf_static(workload, torch_dtype, args.static_batch),
               "hf_cb": lambda: run_hf_continuous(workload, torch_dtype)}[system]
        print("RESULT " + json.dumps(run()), flush=True)
        return
    if args.profile:
        for spec in args.workloads.split(","):
            max_prompt, max_output = (int(x) for x in spec.split(":"))
            profile_tokenweir(sample_workload(args.num_requests, max_prompt, max_output, 49152, args.seed),
                              args.dtype, args, spec)
        return

    names = {"tokenweir": "tokenweir LLM.generate",
             "hf_static": f"transformers generate, static batches of {args.static_batch}",
             "hf_static_tuned": f"the same, with tokenweir's malloc tuning ({_TUNED_MALLOC})",
             "hf_cb": "transformers continuous batching"}
    machine = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, threads {torch.get_num_threads()}"
    command = "`.venv/bin/python benchmarks/offline_throughput.py " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k not in ("one", "profile")) + "`"
    lines = ["# Offline throughput", "",
             f"{args.num_requests} requests whose lengths are sampled (seed {args.seed}) from the Azure LLM "
             "inference trace 2023 (conversation, CC-BY 4.0) and capped as each table says. Default model "
             f"(SmolLM2-135M-Instruct), {args.dtype}, EOS ignored, so each request yields exactly its "
             "sampled output length. Figures are useful output tokens per second: the static batch pays for "
             "left padding and for running every batch to its longest output. Each system runs in its own "
             "fresh Python process, one after the other.", "",
             f"Command: {command}  ", f"Machine: {machine} (shared, noisy: compare ratios within one run).", ""]
    all_results = {}
    for spec in args.workloads.split(","):
        max_prompt, max_output = (int(x) for x in spec.split(":"))
        workload = sample_workload(args.num_requests, max_prompt, max_output, 49152, args.seed)
        results = {}
        for system in args.systems.split(","):
            r = run_in_child(system, spec, args)
            r["tokens_per_s"] = r["useful_tokens"] / r["seconds"]
            results[system] = r
            print(f"[{spec}] {names[system]}: {r['useful_tokens']} tokens in {r['seconds']:.1f} s = "
                  f"{r['tokens_per_s']:.1f} tok/s", flush=True)
        all_results[spec] = results
        prompt_tokens = sum(len(p) for p, _ in workload)
        lines += [f"## Prompts capped at {max_prompt}, outputs at {max_output}", "",
                  f"{prompt_tokens} prompt tokens, {sum(o for _, o in workload)} useful output tokens.", "",
                  "| system | seconds | useful tok/s | vs static batch |", "|---|---|---|---|"]
        base = results.get("hf_static", {}).get("tokens_per_s")
        for system, r in results.items():
            ratio = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
            lines.append(f"| {names[system]} | {r['seconds']:.1f} | {r['tokens_per_s']:.1f} | {ratio} |")
        lines.append("")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "offline_throughput.json").write_text(json.dumps(
        {"args": vars(args), "machine": machine, "results": all_results}, indent=2))
    path = OUT / "offline_throughput.md"
    # Keep the hand-written analysis below the generated tables.
    marker = "\n## Where the time goes"
    old = path.read_text() if path.exists() else ""
    tail = old.split(marker, 1)[1] if marker in old else None
    path.write_text("\n".join(lines) + (marker + tail if tail else ""))


if __name__ == "__main__":
    main()

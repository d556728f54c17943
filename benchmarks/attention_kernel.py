"""The C paged-attention kernel on its own, and the memory it reads, on this machine.

- decode: 64 sequences x 500 tokens of context, SmolLM2's heads (9 query, 3 KV, 64 dims), bf16;
  once with one layer's cache (24.6 MB, partly cache-resident) and once cycling through 30
  layers' caches (740 MB: from DRAM, as in the engine), block tables in random order;
- prefill: one 512-token prompt, causal GFLOP/s;
- the memory ceiling for these reads: a small C program reading a 700 MB buffer in 2 KB pieces
  (one block's keys or values for one KV head) in random and in sequential order, on all threads.

Writes docs/benchmarks/attention_kernel.md and .json.

    .venv/bin/python benchmarks/attention_kernel.py
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from tokenweir.model import kernels

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16

_READ_PROBE = r"""
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <omp.h>
typedef float vf16 __attribute__((vector_size(64)));
typedef uint16_t vu16 __attribute__((vector_size(32)));
typedef int32_t vi16 __attribute__((vector_size(64)));
int main(int argc, char **argv) {
    const size_t chunk = 2048, total = (size_t)700 << 20, n = total / chunk;
    const int random_order = atoi(argv[1]);
    char *buf = aligned_alloc(4096, total);
    memset(buf, 1, total);
    int *order = malloc(sizeof(int) * n);
    for (size_t i = 0; i < n; i++) order[i] = (int)i;
    srand(1);
    if (random_order)
        for (size_t i = n - 1; i > 0; i--) { size_t j = rand() % (i + 1); int t = order[i]; order[i] = order[j]; order[j] = t; }
    double best = 1e9;
    float sink = 0;
    for (int rep = 0; rep < 3; rep++) {
        const double t0 = omp_get_wtime();
#pragma omp parallel reduction(+ : sink)
        {
            vf16 acc = {0};
#pragma omp for schedule(static)
            for (size_t i = 0; i < n; i++) {
                if (i + 2 < n)
                    for (size_t b = 0; b < chunk; b += 64) __builtin_prefetch(buf + (size_t)order[i + 2] * chunk + b);
                const uint16_t *p = (const uint16_t *)(buf + (size_t)order[i] * chunk);
                for (size_t k = 0; k < chunk / 2; k += 16) {
                    vu16 h;
                    memcpy(&h, p + k, sizeof(h));
                    acc += (vf16)(__builtin_convertvector(h, vi16) << 16);  /* widen bf16, as the kernel does */
                }
            }
            sink += acc[0];
        }
        const double dt = omp_get_wtime() - t0;
        if (dt < best) best = dt;
    }
    printf("%.2f %g\n", total / best / 1e9, sink);
    return 0;
}
"""


def read_bandwidth() -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "probe.c", Path(tmp) / "probe"
        src.write_text(_READ_PROBE)
        subprocess.run(["cc", "-O3", "-march=native", "-fopenmp", str(src), "-o", str(exe)], check=True)
        env = dict(os.environ, OMP_NUM_THREADS=str(torch.get_num_threads()))
        return {name: float(subprocess.run([str(exe), flag], capture_output=True, text=True, env=env,
                                            check=True).stdout.split()[0])
                for name, flag in (("random_2kb_gb_s", "1"), ("sequential_gb_s", "0"))}


def decode(layers: int, seqs: int = 64, context: int = 500) -> float:
    """Seconds per layer for one decode step of `seqs` sequences."""
    blocks_per_seq = -(-context // BLOCK)
    num_blocks = seqs * blocks_per_seq + 1
    caches = [torch.randn(2, num_blocks, KV_HEADS, BLOCK * HEAD_DIM).bfloat16() for _ in range(layers)]
    tables = (torch.randperm(num_blocks - 1) + 1).to(torch.int32).view(seqs, blocks_per_seq)
    seq_lens = torch.full((seqs,), context, dtype=torch.int32)
    q_lens = torch.ones(seqs, dtype=torch.int32)
    q_starts = torch.arange(seqs + 1, dtype=torch.int32)
    q = torch.randn(seqs, HEADS, HEAD_DIM).bfloat16()

    def step() -> None:
        for cache in caches:
            kernels.paged_attention(q, cache, tables, q_starts, q_lens, seq_lens, HEAD_DIM**-0.5)

    step()
    rounds = max(3, 150 // layers)
    start = time.perf_counter()
    for _ in range(rounds):
        step()
    return (time.perf_counter() - start) / rounds / layers


def prefill(tokens: int = 512) -> float:
    """Causal GFLOP/s for one prompt of `tokens` tokens."""
    num_blocks = tokens // BLOCK + 1
    cache = torch.randn(2, num_blocks, KV_HEADS, BLOCK * HEAD_DIM).bfloat16()
    table = torch.arange(num_blocks - 1, dtype=torch.int32)[None]
    one = lambda x: torch.tensor([x], dtype=torch.int32)  # noqa: E731
    q = torch.randn(tokens, HEADS, HEAD_DIM).bfloat16()
    q_starts = torch.tensor([0, tokens], dtype=torch.int32)
    run = lambda: kernels.paged_attention(q, cache, table, q_starts, one(tokens), one(tokens), 0.125)  # noqa: E731
    run()
    start = time.perf_counter()
    for _ in range(50):
        run()
    seconds = (time.perf_counter() - start) / 50
    return HEADS * 4 * HEAD_DIM * tokens * tokens / 2 / seconds / 1e9


def main() -> None:
    if not kernels.attention_kernel_available(torch.device("cpu"), torch.bfloat16, HEAD_DIM):
        raise SystemExit("the C kernels are not available (no compiler, or TOKENWEIR_DISABLE_KERNELS=1)")
    kv_bytes = 64 * 500 * 2 * KV_HEADS * HEAD_DIM * 2
    result = {"decode_one_layer_ms": decode(1) * 1e3, "decode_30_layers_ms": decode(30) * 1e3,
              "prefill_512_gflops": prefill(), **read_bandwidth()}
    machine = f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, threads {torch.get_num_threads()}"
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "attention_kernel.json").write_text(json.dumps({"machine": machine, **result}, indent=2))
    lines = [
        "# Attention kernel and memory", "",
        "`.venv/bin/python benchmarks/attention_kernel.py` (bf16, SmolLM2-135M's heads: 9 query, 3 KV, 64 dims;",
        f"block size {BLOCK}; block tables in random order).  ",
        f"Machine: {machine} (shared, noisy).", "",
        "| measurement | result |", "|---|---|",
        f"| decode, 64 sequences x 500 tokens, one layer's cache (24.6 MB) | {result['decode_one_layer_ms']:.2f} ms "
        f"({kv_bytes / result['decode_one_layer_ms'] / 1e6:.0f} GB/s of K/V) |",
        f"| the same cycling through 30 layers' caches (740 MB, from DRAM) | {result['decode_30_layers_ms']:.2f} ms "
        f"a layer ({kv_bytes / result['decode_30_layers_ms'] / 1e6:.0f} GB/s) |",
        f"| prefill, one 512-token prompt (causal FLOPs) | {result['prefill_512_gflops']:.0f} GFLOP/s |",
        f"| reading a 700 MB buffer in random 2 KB pieces, bf16 widened, all threads | "
        f"{result['random_2kb_gb_s']:.0f} GB/s |",
        f"| the same in sequential order | {result['sequential_gb_s']:.0f} GB/s |", "",
        "A decode step's K/V reads are a request's blocks for one KV head each: 2 KB pieces wherever",
        "the block pool put them, so the random-read figure is the ceiling to compare the DRAM decode",
        "figure with.", ""]
    (OUT / "attention_kernel.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

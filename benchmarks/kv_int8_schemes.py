"""Which int8 K/V scheme measures best: a scale per token and KV head, per group of 32 or 16
channels (32 is what tokenweir ships), and K or V left exact.

Fake quantisation: the engine runs the default model in fp32 on its torch path
(TOKENWEIR_DISABLE_KERNELS=1), and every K/V row is quantised and dequantised by the scheme
under test before it is written to the (fp32) cache. So each scheme's rounding is exactly what
int8 storage with that scheme would give, without building its storage; bytes per token are
computed, not stored. Greedy continuations of benchmarks/kv_int8.py's prompts against the same
engine without quantisation: tokens agreeing before the first difference, and the mean change of
the sampled token's logprob while they agree. Writes docs/benchmarks/kv_int8_schemes.md and .json.

    .venv/bin/python benchmarks/kv_int8_schemes.py
"""

from __future__ import annotations

import os

os.environ["TOKENWEIR_DISABLE_KERNELS"] = "1"  # the torch path, where K/V pass through write_kv

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Optional  # noqa: E402

import torch  # noqa: E402

from tokenweir import SamplingParams  # noqa: E402
from tokenweir.config import EngineArgs  # noqa: E402
from tokenweir.core.kv_cache_manager import INT8_SCALE_BYTES  # noqa: E402
from tokenweir.engine.core import EngineCore  # noqa: E402
from tokenweir.machine import cpu_name  # noqa: E402
from tokenweir.model import attention  # noqa: E402
from tokenweir.model.loader import load_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kv_int8 import DOC_QUESTIONS, QUESTIONS, ROOT, agreement, chat, run  # noqa: E402

OUT = ROOT / "docs" / "benchmarks"
HEAD_DIM, BLOCK_BYTES = 64, 16 * 64 * 2  # the default model's head, a bf16 block of 16 per head
# Channels per scale for K and for V (None: left exact), per scheme.
SCHEMES: dict[str, tuple[Optional[int], Optional[int]]] = {
    "one scale per head": (HEAD_DIM, HEAD_DIM), "K exact, V one scale per head": (None, HEAD_DIM),
    "K one scale per head, V exact": (HEAD_DIM, None), "groups of 32 channels (shipped)": (32, 32),
    "groups of 16 channels": (16, 16), "K in groups of 16, V one scale per head": (16, HEAD_DIM)}


def fake_quantize(x: torch.Tensor, group: Optional[int]) -> torch.Tensor:
    """x [..., d] rounded as symmetric int8 with a scale per `group` channels of each row."""
    if group is None:
        return x
    grouped = x.float().reshape(*x.shape[:-1], x.shape[-1] // group, group)
    scale = grouped.abs().amax(-1, keepdim=True) / 127
    q = torch.round(grouped / torch.where(scale > 0, scale, 1)).clamp(-127, 127)
    return (q * scale).reshape(x.shape).to(x.dtype)


def tokens_per_block(k_group: Optional[int], v_group: Optional[int]) -> float:
    """What a bf16 block's bytes would hold: K and V regions are alike, so the costlier side decides."""
    def per_token(group: Optional[int]) -> int:
        return 2 * HEAD_DIM if group is None else HEAD_DIM + INT8_SCALE_BYTES * (HEAD_DIM // group)
    return BLOCK_BYTES // max(per_token(k_group), per_token(v_group)) // 2 * 2


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=64)
    ns = parser.parse_args()
    scheme: list[Optional[int]] = [None, None]
    write_kv = attention.write_kv

    def quantising_write(kv_cache, k, v, slot_mapping, **kwargs):
        write_kv(kv_cache, fake_quantize(k, scheme[0]), fake_quantize(v, scheme[1]), slot_mapping, **kwargs)

    attention.write_kv = quantising_write
    loaded = load_model(None, "float32", "cpu")
    document = (ROOT / "docs" / "architecture.md").read_text()[:6000]
    sets = {"short questions": [chat(loaded.tokenizer, q) for q in QUESTIONS],
            "questions over a document": [chat(loaded.tokenizer, f"{document}\n\n{q}") for q in DOC_QUESTIONS]}
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=0.0, logprobs=0, ignore_eos=True)
    engine = EngineCore(EngineArgs(kv_cache_memory="256MiB"), loaded)
    reference = {name: run(engine, prompts, params, [0] * len(prompts))["outputs"] for name, prompts in sets.items()}
    results = {}
    for name, groups in SCHEMES.items():
        scheme[:] = groups
        results[name] = {"tokens_per_bf16_block_of_16": tokens_per_block(*groups)}
        for set_name, prompts in sets.items():
            rows = [agreement(a, b) for a, b in
                    zip(reference[set_name], run(engine, prompts, params, [0] * len(prompts))["outputs"])]
            results[name][set_name] = {
                "mean_agreeing_tokens": round(statistics.fmean(r["agreeing_tokens"] for r in rows), 1),
                "mean_logprob_delta": round(statistics.fmean(r["mean_logprob_delta"] for r in rows), 4)}
        print(name, results[name], flush=True)
    data = {"machine": f"{cpu_name()}, torch {torch.__version__}", "model": loaded.name,
            "measured_at": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
            "command": " ".join(["python", "benchmarks/kv_int8_schemes.py", *sys.argv[1:]]),
            "max_tokens": ns.max_tokens, "results": results}
    (OUT / "kv_int8_schemes.json").write_text(json.dumps(data, indent=2) + "\n")
    lines = ["# Int8 K/V schemes compared (fake quantisation, fp32)", "",
             f"`{data['command']}` on {data['model']} in float32, torch path. Machine: {data['machine']}, "
             f"{data['measured_at']}. Data: [kv_int8_schemes.json](kv_int8_schemes.json). Each scheme's "
             "rounding is applied to every K/V row before the fp32 cache stores it; the storage itself is "
             "not built (bytes computed, with float32 scales).", "",
             f"Against the same engine unquantised, greedy, {ns.max_tokens} tokens: mean tokens agreeing "
             "before the first difference, and the mean change of the sampled token's logprob while they "
             "agree.", "",
             "| scheme | tokens per bf16 block of 16 | short questions: agreeing | logprob change | "
             "document questions: agreeing | logprob change |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        short, doc = r["short questions"], r["questions over a document"]
        lines.append(f"| {name} | {r['tokens_per_bf16_block_of_16']} | {short['mean_agreeing_tokens']} | "
                     f"{short['mean_logprob_delta']} | {doc['mean_agreeing_tokens']} | {doc['mean_logprob_delta']} |")
    (OUT / "kv_int8_schemes.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

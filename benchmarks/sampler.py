"""The sampler's cost per step on synthetic logits, by what the rows ask for.

SmolLM2's vocabulary (49,152), bf16 logits, 32 and 256 rows. Cases:
- greedy rows alone (the C argmax path), and temperature sampling, top-k 50, top-p 0.9;
- every row greedy with a repetition penalty and a frequency penalty over a history of 2,000
  prompt + 500 output tokens, read from each request's `TokenHistory` (what the runner passes)
  and, for comparison, from Python lists (what the runner passed before that existed; the
  runner's own slicing of the lists, which came on top, is not counted);
- every row greedy with a logit_bias of 1,024 entries (OpenAI's cap is 300; tokenweir's 1,024),
  the bias tensors built once per request (as the runner does) and from the dicts.

Each figure is the best of `--repeats` calls, SamplingMetadata.build included (the runner
builds it every step). Writes docs/benchmarks/sampler.md and .json.

    .venv/bin/python benchmarks/sampler.py
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from tokenweir.machine import cpu_name
from tokenweir.model.sampler import Sampler, SamplingMetadata, TokenHistory, bias_tensors

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
VOCAB = 49152
PROMPT_LEN, OUTPUT_LEN, BIAS_ENTRIES = 2000, 500, 1024


def cases(rows: int, rng: random.Random) -> dict[str, dict]:
    histories = [TokenHistory([rng.randrange(VOCAB) for _ in range(PROMPT_LEN + OUTPUT_LEN)], PROMPT_LEN, "cpu")
                 for _ in range(rows)]
    lists = [(h.prompt.tolist(), h.output.tolist()) for h in histories]
    biases = [{t: rng.uniform(-5, 5) for t in rng.sample(range(VOCAB), BIAS_ENTRIES)} for _ in range(rows)]
    built = [bias_tensors(b, "cpu") for b in biases]
    greedy = [0.0] * rows
    penalties = dict(repetition_penalty=[1.1] * rows, frequency_penalty=[0.5] * rows)
    return {
        "greedy": dict(temperature=greedy),
        "temperature 0.8": dict(temperature=[0.8] * rows),
        "top_k 50": dict(temperature=[0.8] * rows, top_k=[50] * rows),
        "top_p 0.9": dict(temperature=[0.8] * rows, top_p=[0.9] * rows),
        "greedy + repetition and frequency penalties (TokenHistory)": dict(
            temperature=greedy, prompt_token_ids=[h.prompt for h in histories],
            output_token_ids=[h.output for h in histories], **penalties),
        "greedy + repetition and frequency penalties (lists)": dict(
            temperature=greedy, prompt_token_ids=[p for p, _ in lists], output_token_ids=[o for _, o in lists],
            **penalties),
        f"greedy + logit_bias of {BIAS_ENTRIES} (tensors built once)": dict(temperature=greedy, logit_bias=built),
        f"greedy + logit_bias of {BIAS_ENTRIES} (dicts)": dict(temperature=greedy, logit_bias=biases),
    }


def best_ms(logits: torch.Tensor, kwargs: dict, repeats: int) -> float:
    sampler, best = Sampler(), float("inf")
    temperature = kwargs.pop("temperature")
    for _ in range(repeats):
        start = time.perf_counter()
        sampler(logits, SamplingMetadata.build(temperature, **kwargs))
        best = min(best, time.perf_counter() - start)
    kwargs["temperature"] = temperature
    return 1000 * best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="32,256")
    parser.add_argument("--repeats", type=int, default=10)
    ns = parser.parse_args()
    rng = random.Random(0)
    torch.manual_seed(0)
    results: dict[str, dict[str, float]] = {}
    sizes = [int(r) for r in ns.rows.split(",")]
    for rows in sizes:
        logits = torch.randn(rows, VOCAB).to(torch.bfloat16)
        for name, kwargs in cases(rows, rng).items():
            results.setdefault(name, {})[str(rows)] = round(best_ms(logits, kwargs, ns.repeats), 2)
            print(f"{rows:>4} rows  {name}: {results[name][str(rows)]} ms", flush=True)
    machine = f"{cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} threads"
    measured_at = time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())
    command = "python benchmarks/sampler.py" + (f" --rows {ns.rows}" if ns.rows != "32,256" else "")
    (OUT / "sampler.json").write_text(json.dumps(
        {"machine": machine, "measured_at": measured_at, "command": command, "vocab": VOCAB, "prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN,
         "bias_entries": BIAS_ENTRIES, "repeats": ns.repeats, "ms": results}, indent=2) + "\n")
    lines = ["# Sampler cost per step", "",
             f"`{command}` (best of {ns.repeats} calls, `SamplingMetadata.build` included; bf16 logits, "
             f"vocabulary {VOCAB:,}; penalised rows carry {PROMPT_LEN:,} prompt + {OUTPUT_LEN} output tokens).  ",
             f"Machine: {machine} (shared: single runs carry noise), {measured_at}. Data: [sampler.json](sampler.json).",
             "",
             "| case | " + " | ".join(f"{r} rows" for r in sizes) + " |",
             "|---|" + "---|" * len(sizes)]
    lines += [f"| {name} | " + " | ".join(f"{by[str(r)]} ms" for r in sizes) + " |" for name, by in results.items()]
    lines += ["", "The lists and dicts rows are what the runner handed the sampler before each request's "
              "`TokenHistory` and bias tensors were kept; the runner's slicing of the lists came on top of them. "
              "The logits are random, so flat: top-p's nucleus is not among the best 1,024 candidates and it "
              "takes the full-sort fallback (a model's peaked logits rarely do)."]
    (OUT / "sampler.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

"""The correctness oracle: transformers' greedy `generate` in fp32 on the same weights."""

from __future__ import annotations

import torch


def hf_greedy(folder: str, prompts: list[list[int]], num_new: int, pad_token_id: int,
              **generate_kwargs) -> list[list[int]]:
    """Exactly `num_new` greedy tokens per prompt, one prompt at a time (no padding effects).
    min_new_tokens masks EOS as tokenweir's min_tokens does. `generate_kwargs` go to
    `generate` (logits processors, penalties)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=num_new, min_new_tokens=num_new, pad_token_id=pad_token_id,
                                 **generate_kwargs)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs

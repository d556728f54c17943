"""`cache_salt` in LLM prompts (vLLM's field): requests with different salts never share cached
blocks, while the answer stays the same."""

from __future__ import annotations

import pytest

from tokenweir import SamplingParams

KV = dict(num_gpu_blocks_override=128)
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPT = "the capital of france is the capital of france is the capital of france is a city"


def test_a_salt_isolates_the_prefix_cache_and_keeps_the_answer(make_llm, tiny_model_dir):
    llm = make_llm(tiny_model_dir("llama"), **KV)
    first = llm.generate({"prompt": PROMPT, "cache_salt": "tenant-a"}, GREEDY, use_tqdm=False)[0]
    same = llm.generate({"prompt": PROMPT, "cache_salt": "tenant-a"}, GREEDY, use_tqdm=False)[0]
    other = llm.generate({"prompt": PROMPT, "cache_salt": "tenant-b"}, GREEDY, use_tqdm=False)[0]
    unsalted = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0]
    assert len(first.prompt_token_ids) > 16  # at least one full block to share
    assert first.metrics.num_cached_tokens == 0
    assert same.metrics.num_cached_tokens > 0
    assert other.metrics.num_cached_tokens == 0 and unsalted.metrics.num_cached_tokens == 0
    texts = {o.outputs[0].text for o in (first, same, other, unsalted)}
    assert len(texts) == 1


@pytest.mark.parametrize("prompt, message", [
    ({"prompt": PROMPT, "cache_salt": ""}, "cache_salt must be a non-empty string"),
    ({"prompt": PROMPT, "cache_salt": 7}, "cache_salt must be a non-empty string"),
    ({"prompt": PROMPT, "salt": "x"}, r"unknown prompt keys \['salt'\]"),
    ({"prompt": 5}, "'prompt' must be a string, got int"),
    ({"prompt": PROMPT, "prompt_token_ids": [1]}, "a prompt must be a string"),
])
def test_bad_prompt_dicts_are_refused_before_anything_is_queued(make_llm, tiny_model_dir, prompt, message):
    llm = make_llm(tiny_model_dir("llama"), **KV)
    with pytest.raises(ValueError, match=message):
        llm.generate(["ok", prompt], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()

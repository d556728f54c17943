"""Greedy output equals transformers' greedy generate, token for token (fp32), whatever the
batching, chunking, preemption or prefix-cache hits."""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.helpers import greedy_under_scenario
from tests.hf_reference import hf_greedy

NUM_NEW = 10


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    prompts = []
    for length in (1, 3, 7, 16, 17, 33, 60, 90):
        prompts.append([rng.randrange(3, vocab) for _ in range(length)])
    # Prompts sharing a 40-token prefix, for prefix-cache hits.
    for tail in (2, 9, 21):
        prompts.append(shared + [rng.randrange(3, vocab) for _ in range(tail)])
    return prompts


SCENARIOS = {
    "batched": dict(num_gpu_blocks_override=256),
    "chunked": dict(num_gpu_blocks_override=256, max_num_batched_tokens=16),
    "preempted": dict(num_gpu_blocks_override=24, max_num_batched_tokens=64, block_size=8),
    "prefix_hits": dict(num_gpu_blocks_override=256, max_num_seqs=2),
    # A tiny Llama's block of 8 is 6 kB: 1 MiB of swap space holds every victim, 8 kB one block.
    "swapped": dict(num_gpu_blocks_override=24, max_num_batched_tokens=64, block_size=8,
                    preemption_mode="swap", swap_space=2**-10),
    "auto": dict(num_gpu_blocks_override=24, max_num_batched_tokens=64, block_size=8,
                 preemption_mode="auto", swap_space=2**-10),
    "swap_exhausted": dict(num_gpu_blocks_override=24, max_num_batched_tokens=64, block_size=8,
                           preemption_mode="swap", swap_space=2**-17),
}


def check_scenario(make_llm, folder, prompts, expected, scenario):
    got = greedy_under_scenario(make_llm(folder, **SCENARIOS[scenario]), prompts, NUM_NEW, scenario)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} (len {len(prompts[i])}) differs in scenario {scenario}"


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_greedy_matches_transformers_on_tiny_models(make_llm, tiny_model_dir, arch):
    folder = tiny_model_dir(arch)
    from tests.model.tiny_models import VOCAB_SIZE

    prompts = make_prompts(VOCAB_SIZE)
    expected = hf_greedy(folder, prompts, NUM_NEW, pad_token_id=0)
    for scenario in SCENARIOS:
        check_scenario(make_llm, folder, prompts, expected, scenario)


def test_torch_attention_path_matches_transformers(make_llm, tiny_model_dir, monkeypatch):
    """The path CUDA (and a CPU without a C compiler) takes: SDPA over gathered K/V, torch
    elementwise ops. Same scenarios, kernels switched off."""
    from tokenweir.model import kernels
    from tests.model.tiny_models import VOCAB_SIZE

    monkeypatch.setenv("TOKENWEIR_DISABLE_KERNELS", "1")
    kernels._library.cache_clear()  # so that it reads the variable again (and again after)
    try:
        assert not kernels.attention_kernel_available(torch.device("cpu"), torch.float32, 64)
        folder = tiny_model_dir("llama")
        prompts = make_prompts(VOCAB_SIZE)
        expected = hf_greedy(folder, prompts, NUM_NEW, pad_token_id=0)
        for scenario in SCENARIOS:
            check_scenario(make_llm, folder, prompts, expected, scenario)
    finally:
        kernels._library.cache_clear()

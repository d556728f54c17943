"""Admission orders change only the order: greedy outputs still equal transformers' greedy
generate token for token, with prefix hits and evictions on a small pool."""

from __future__ import annotations

import random

import pytest

from tests.engine.helpers import record_schedules
from tests.hf_reference import hf_greedy
from tokenweir import SamplingParams

NUM_NEW = 6


def shared_prefix_prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(3)
    prefixes = [[rng.randrange(3, vocab) for _ in range(32)] for _ in range(3)]
    # Interleaved prefixes, as a cache-blind order sees them; lengths vary for length-aware.
    return [prefixes[i % 3] + [rng.randrange(3, vocab) for _ in range(1 + 5 * (i % 4))] for i in range(12)]


def admission_sequence(llm, prompts) -> tuple[list[list[int]], list[str]]:
    schedules = record_schedules(llm.engine)
    params = SamplingParams(max_tokens=NUM_NEW, min_tokens=NUM_NEW, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    first_seen: list[str] = []
    for out in schedules:
        first_seen += [r.request_id for r in out.scheduled_new_reqs if r.request_id not in first_seen]
    return [o.outputs[0].token_ids for o in outs], first_seen


@pytest.mark.parametrize("order", ["cache-aware", "length-aware", ("length-aware", "cache-aware")])
def test_admission_orders_keep_greedy_outputs_equal_to_transformers(make_llm, tiny_model_dir, order):
    from tests.model.tiny_models import VOCAB_SIZE

    folder = tiny_model_dir("llama")
    prompts = shared_prefix_prompts(VOCAB_SIZE)
    expected = hf_greedy(folder, prompts, NUM_NEW, pad_token_id=0)
    # 40 blocks of 4: room for two prefixes beside the running requests, so prefixes are evicted.
    engine = dict(num_gpu_blocks_override=40, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    baseline, fcfs_order = admission_sequence(make_llm(folder, **engine), prompts)
    got, composed_order = admission_sequence(
        make_llm(folder, admission_order=order, admission_max_wait=1e6, **engine), prompts)
    assert composed_order != fcfs_order, "the order under test never changed anything"
    assert baseline == expected
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"prompt {i} differs under admission order {order}"

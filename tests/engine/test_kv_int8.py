"""Int8 K/V for low-priority requests through the real engine (tiny model, fp32, C kernels):
requests above the threshold are untouched (transformers' greedy tokens exactly, batched with
int8 ones, under chunking and preemption); int8 requests stay close to the model: at every
position of their own output, the logprob the engine reports is transformers' fp32 logprob of
that token within a small error, and not equal to it (the K/V really are int8)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.helpers import greedy_oracle
from tokenweir import SamplingParams
from tokenweir.metrics import EngineMetrics
from tokenweir.request import SchedulingHints

NUM_NEW = 20
PROMPTS = {f"r{i}": [3 + (11 * i + 5 * j) % 97 for j in range(9 + 5 * i)] for i in range(8)}
PRIORITY = {rid: i % 2 for i, rid in enumerate(PROMPTS)}  # odd ones are low priority: int8


@pytest.fixture(scope="module")
def oracle(tiny_model_dir) -> dict[str, list[int]]:
    return greedy_oracle(tiny_model_dir("llama"), PROMPTS, NUM_NEW)


def _hf_logprobs(folder: str, prompt: list[int], output: list[int]) -> list[float]:
    """transformers' fp32 logprob of each output token, teacher-forced on prompt + output."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    return [logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(output)]


def _run(engine, metrics: EngineMetrics) -> tuple[dict, dict, int]:
    params = SamplingParams(max_tokens=NUM_NEW, min_tokens=NUM_NEW, temperature=0.0, logprobs=0)
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, params, SchedulingHints(priority=PRIORITY[rid]))
    tokens, logprobs, most_int8 = {}, {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step().outputs:
            if out.finished:
                completion = out.outputs[0]
                tokens[out.request_id] = completion.token_ids
                logprobs[out.request_id] = [lp[t] for lp, t in zip(completion.logprobs, completion.token_ids)]
        stats = engine.get_stats()
        metrics.record_scheduler_stats(stats)
        most_int8 = max(most_int8, int(metrics.num_requests_running_kv_int8._value.get()))
        assert stats.num_running_kv_int8 == sum(r.kv_int8 for r in engine.scheduler.running)
    return tokens, logprobs, most_int8


@pytest.mark.parametrize("preemption", [{}, {"preemption_mode": "swap", "swap_space": 2**-10}],
                         ids=["recompute", "swap"])
def test_int8_for_low_priority_only(make_llm, tiny_model_dir, oracle, preemption):
    folder = tiny_model_dir("llama")
    # 14 blocks of 8 tokens: the eight requests (up to 64 tokens each) preempt one another;
    # a budget of 16 chunks every prompt but the first.
    engine = make_llm(folder, num_gpu_blocks_override=14, block_size=8, max_num_batched_tokens=16,
                      low_priority_kv_cache_dtype="int8", **preemption).engine
    assert engine.cache_config.int8_block_size == 24  # 8 x 16 x 4 bytes, 20 per int8 token with its scale
    metrics = EngineMetrics("tiny", 16, engine.max_model_len)
    tokens, logprobs, most_int8 = _run(engine, metrics)
    assert engine.get_stats().num_preemptions > 0 and most_int8 > 0
    high = {rid for rid, p in PRIORITY.items() if p == 0}
    assert {rid: tokens[rid] for rid in high} == {rid: oracle[rid] for rid in high}
    worst, exact = 0.0, True
    for rid in set(PROMPTS) - high:
        assert len(tokens[rid]) == NUM_NEW
        reference = _hf_logprobs(folder, PROMPTS[rid], tokens[rid])
        errors = [abs(a - b) for a, b in zip(logprobs[rid], reference)]
        worst = max(worst, *errors)
        exact = exact and max(errors) < 1e-6
    assert worst < 0.05, f"int8 K/V moved a logprob by {worst}"
    assert not exact, "the low-priority requests' K/V were not quantised"


def test_without_int8_the_low_priority_requests_are_exact_too(make_llm, tiny_model_dir, oracle):
    """The control: the same engine without the flag keeps every request on the oracle."""
    engine = make_llm(tiny_model_dir("llama"), num_gpu_blocks_override=14, block_size=8,
                      max_num_batched_tokens=16).engine
    tokens, _, most_int8 = _run(engine, EngineMetrics("tiny", 16, engine.max_model_len))
    assert tokens == oracle and most_int8 == 0


def test_int8_that_would_hold_no_more_tokens_is_refused(tiny_model_dir):
    """bf16 blocks of 2 tokens at head_dim 16 hold 64 bytes per head: 2 int8 tokens with their
    scales, no gain for the accuracy given up."""
    from tokenweir import LLM

    with pytest.raises(ValueError, match="holds 2 int8 tokens with their scales, no more than it holds now"):
        LLM(tiny_model_dir("llama"), dtype="bfloat16", device="cpu", block_size=2, num_gpu_blocks_override=64,
            low_priority_kv_cache_dtype="int8")

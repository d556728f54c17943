"""A GGUF's RoPE scaling survives conversion: Llama 3's `rope_freqs` tensor and linear scaling
metadata, which transformers' GGUF config reader drops for llama.

The tiny scaled Llamas are written as llama.cpp's converter would (tiny_models.write_tiny_gguf);
tokenweir must then generate from the GGUF what it, and transformers, generate from the HF
folder -- on prompts past the original context (64 positions), where the scaling matters.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.hf_reference import hf_greedy
from tests.model.tiny_models import VOCAB_SIZE, write_stub_gguf, write_tiny_gguf
from tokenweir.model import arch as model_arch
from tokenweir.model import gguf_conversion, loader

NUM_NEW = 8


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    # Conversions of this test's GGUFs only: the compiled kernels stay in the shared cache.
    monkeypatch.setattr(gguf_conversion, "cache_root", lambda: tmp_path / "cache")
    return tmp_path / "cache"


def tokenweir_greedy(model: str, prompts: list[list[int]]) -> list[list[int]]:
    from tokenweir import LLM, SamplingParams

    llm = LLM(model, dtype="float32", device="cpu")
    params = SamplingParams(max_tokens=NUM_NEW, min_tokens=NUM_NEW, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["llama3", "linear"])
def test_gguf_rope_scaling_matches_hf_folder(tmp_path, tiny_model_dir, arch):
    folder = tiny_model_dir(arch)
    gguf_path = write_tiny_gguf(folder, str(tmp_path / f"{arch}.gguf"))
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in (20, 150, 400)]

    expected = hf_greedy(folder, prompts, NUM_NEW, pad_token_id=0)
    assert tokenweir_greedy(folder, prompts) == expected
    assert tokenweir_greedy(gguf_path, prompts) == expected

    # Without its scaling the converted model gives other tokens on these prompts: the
    # comparison above could have failed.
    config_path = Path(gguf_conversion.ensure_hf_folder(gguf_path)) / "config.json"
    cfg = json.loads(config_path.read_text())
    cfg.pop(model_arch.ROPE_FREQ_FACTORS_KEY, None)
    cfg["rope_parameters"]["rope_type"] = "default"
    config_path.write_text(json.dumps(cfg))
    assert tokenweir_greedy(gguf_path, prompts) != expected


def test_llama3_gguf_carries_rope_freqs_as_factors(tmp_path, tiny_model_dir):
    gguf_path = write_tiny_gguf(tiny_model_dir("llama3"), str(tmp_path / "llama3.gguf"))
    converted = loader.load_model(gguf_path, dtype="float32", device="cpu")
    reference = loader.load_model(tiny_model_dir("llama3"), dtype="float32", device="cpu")
    # 8 rotary pairs: one kept, two interpolated, five slowed down by the factor (8)
    factors = converted.arch.rope_freq_factors
    assert factors is not None and factors[0] == 1.0 and 1.0 < factors[1] < factors[2] < 8.0
    assert factors[3:] == (8.0,) * 5
    assert converted.arch.rope_scaling is None
    tok = converted.tokenizer  # the GGUF's byte-level vocabulary, read by transformers
    assert tok.eos_token_id == 2 and tok.decode(tok(" the cat").input_ids, skip_special_tokens=True) == " the cat"
    # float32 angles up to position 511: equal to rounding
    assert (converted.model.rope_cos - reference.model.rope_cos).abs().max() < 1e-4
    assert (converted.model.rope_sin - reference.model.rope_sin).abs().max() < 1e-4


def test_unsupported_gguf_rope_scaling(tmp_path):
    import gguf

    def yarn(writer):
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)

    with pytest.raises(ValueError, match="unsupported RoPE scaling type 'yarn'"):
        loader.load_model(write_stub_gguf(str(tmp_path / "yarn.gguf"), "llama", yarn))


def test_rope_freq_factors_config_key():
    base = dict(
        architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=2,
    )  # head_dim 4: two rotary pairs
    arch = model_arch.arch_from_hf_config({**base, model_arch.ROPE_FREQ_FACTORS_KEY: [1, 2.5]})
    assert arch.rope_freq_factors == (1.0, 2.5)
    for bad in ([1.0], [1.0, 0.0], [1.0, True], [1.0, float("inf")], "1 2"):
        with pytest.raises(ValueError, match="must list 2 positive numbers"):
            model_arch.arch_from_hf_config({**base, model_arch.ROPE_FREQ_FACTORS_KEY: bad})

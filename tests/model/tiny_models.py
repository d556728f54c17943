"""Tiny random-weight Hugging Face models and a tiny tokenizer, built in code (nothing downloaded).

Reusable by any test that needs a real model folder: `make_tiny_model(folder, "llama")` writes
config.json, model.safetensors and tokenizer files that `tokenweir.model.load_model` and
transformers both load; `write_tiny_gguf` writes such a model as llama.cpp would convert it.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

SPECIAL_TOKENS = ["<unk>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1 (bos), 2 (eos) as in SmolLM2
WORDS = (
    "the a an of to in is it you that he was for on are with as his they be at one have this from "
    "or had by hot word but what some we can out other were all there when up use your how said "
    "each she which do their time if will way about many then them write would like so these her "
    "long make thing see him two has look more day could go come did number sound no most people "
    "my over know water than call first who may down side been now find paris france capital city "
    "user assistant system hello world yes . , ? ! 0 1 2 3 4 5 6 7 8 9"
).split()
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|> {{ message['role'] }} {{ message['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
VOCAB_SIZE = 256  # model vocab; larger than the tokenizer's, as in many real checkpoints

ARCHS = ("llama", "qwen2", "mistral", "llama3", "linear")


def make_tiny_tokenizer() -> Any:
    """A word-level fast tokenizer with a chat template; eos = <|im_end|> (id 2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_config(arch: str, **overrides: Any) -> Any:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common: dict[str, Any] = dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        initializer_range=0.1,
        rope_theta=10000.0,
    )
    if arch == "llama":
        cfg = LlamaConfig(**{**common, "tie_word_embeddings": True, **overrides})
    elif arch == "qwen2":
        cfg = Qwen2Config(**{**common, "tie_word_embeddings": False, **overrides})
    elif arch == "mistral":
        cfg = MistralConfig(**{**common, "tie_word_embeddings": False, "sliding_window": None, **overrides})
    elif arch == "llama3":
        # head_dim 16 and an original context of 64: all three wavelength bands occur.
        scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        cfg = LlamaConfig(**{**common, "rope_scaling": scaling, **overrides})
    elif arch == "linear":
        cfg = LlamaConfig(**{**common, "rope_scaling": {"rope_type": "linear", "factor": 2.0}, **overrides})
    else:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {ARCHS}")
    return cfg


def make_tiny_model(folder: str, arch: str = "llama", seed: int = 0, **overrides: Any) -> str:
    """Save a random-weight model of `arch` plus the tiny tokenizer to `folder`; return it."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides), dtype=torch.float32)
    with torch.no_grad():
        # HF initialises norms to 1 and biases to 0; perturb them so that tests notice if
        # either is dropped or misplaced.
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(folder)
    make_tiny_tokenizer().save_pretrained(folder)
    return folder


# llama.cpp's tensor names for the HF weights of a Llama layer (blk.N.*) and of the whole model.
_GGUF_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def llama3_rope_freqs(scaling: dict[str, Any], theta: float, head_dim: int) -> list[float]:
    """llama.cpp's `rope_freqs` for Llama 3 scaling: per rotary pair i, the divisor of
    theta^(-2i/d). Pairs with short wavelengths keep their speed, long ones are slowed down by
    `factor`, and in between the speed (1 / divisor) is interpolated linearly in frequency."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    divisors = []
    for i in range(head_dim // 2):
        wavelength = 2 * math.pi * theta ** (2 * i / head_dim)
        if wavelength < context / high:
            divisors.append(1.0)
        elif wavelength > context / low:
            divisors.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            divisors.append(1.0 / ((1 - smooth) / factor + smooth))
    return divisors


def _gguf_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of a byte-level BPE vocabulary of VOCAB_SIZE tokens: the
    special tokens at their usual ids, single bytes, and one merge (GGUF arrays cannot be empty).
    A GGUF cannot describe the word-level tokenizer of the HF folders."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()  # byte -> the character byte-level BPE spells it with
    merges = [f"{byte_chars[ord(' ')]} t"]
    singles = [byte_chars[b] for b in range(VOCAB_SIZE - len(SPECIAL_TOKENS) - len(merges))]
    tokens = SPECIAL_TOKENS + singles + [m.replace(" ", "") for m in merges]
    types = [gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.NORMAL for t in tokens]
    return tokens, types, merges


def _interleave_rotary_rows(w: Any, n_head: int) -> Any:
    # HF rotates the two halves of each head; llama.cpp adjacent pairs: rows (head, half, pair)
    # -> (head, pair, half).
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf_name: str) -> str:
    stem, _, kind = hf_name.rpartition(".")
    if stem in _GGUF_GLOBAL:
        return f"{_GGUF_GLOBAL[stem]}.{kind}"
    _, _, index, layer_part = stem.split(".", 3)  # model.layers.N.<part>
    return f"blk.{index}.{_GGUF_LAYER[layer_part]}.{kind}"


def write_tiny_gguf(folder: str, path: str) -> str:
    """Write the tiny Llama in `folder` as llama.cpp's converter would (fp32, arch "llama"):
    q/k rows interleaved, linear RoPE scaling as metadata, Llama 3 scaling as a `rope_freqs`
    tensor; with the byte-level vocabulary of `_gguf_vocab`. Returns `path`."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(folder)
    rope = cfg.rope_parameters
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    tokens, types, merges = _gguf_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_chat_template(CHAT_TEMPLATE)
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope["rope_type"] == "llama3":
        freqs = llama3_rope_freqs(rope, rope["rope_theta"], cfg.head_dim)
        writer.add_tensor("rope_freqs.weight", np.array(freqs, dtype=np.float32))
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
    for hf_name, w in load_file(f"{folder}/model.safetensors").items():
        name = _gguf_name(hf_name)
        role = name.split(".")[-2]
        writer.add_tensor(name, _interleave_rotary_rows(w, heads[role]) if role in heads else w)
    _finish_gguf(writer)
    return path


def _finish_gguf(writer: Any) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_stub_gguf(path: str, arch: str, add_metadata: Callable[[Any], None] = lambda writer: None) -> str:
    """A GGUF holding metadata and one small tensor: enough for the loader to read and refuse it."""
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(path, arch)
    add_metadata(writer)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    _finish_gguf(writer)
    return path

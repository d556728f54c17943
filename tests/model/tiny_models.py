"""Tiny random-weight Hugging Face models and a tiny tokenizer, built in code (nothing downloaded).

Reusable by any test that needs a real model folder: `make_tiny_model(folder, "llama")` writes
config.json, model.safetensors and tokenizer files that `tokenweir.model.load_model` and
transformers both load.
"""

from __future__ import annotations

from typing import Any

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

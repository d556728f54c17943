"""Model execution: loading, the Llama-family decoder, paged attention and sampling.

torch lives here, except in `arch.py` (the model's description, which sizes KV pools without
torch). The names below are imported on first use, so that importing `tokenweir.model.arch`
does not import torch.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "AttentionMetadata": "attention",
    "LlamaForCausalLM": "llama",
    "LoadedModel": "loader",
    "ModelArchConfig": "arch",
    "Sampler": "sampler",
    "SamplerOutput": "sampler",
    "SamplingMetadata": "sampler",
    "allocate_kv_caches": "attention",
    "arch_from_hf_folder": "arch",
    "default_model_path": "loader",
    "ensure_hf_folder": "gguf_conversion",
    "kv_cache_bytes_per_block": "arch",
    "load_model": "loader",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tokenweir.model' has no attribute {name!r}")
    return getattr(import_module(f"tokenweir.model.{_EXPORTS[name]}"), name)

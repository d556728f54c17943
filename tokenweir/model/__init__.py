"""Model execution: loading, the Llama-family decoder, paged attention and sampling.

torch lives here and only here.
"""

from tokenweir.model.attention import AttentionMetadata, allocate_kv_caches, kv_cache_bytes_per_block
from tokenweir.model.llama import LlamaForCausalLM, ModelArchConfig
from tokenweir.model.gguf_conversion import ensure_hf_folder
from tokenweir.model.loader import LoadedModel, default_model_path, load_model
from tokenweir.model.sampler import Sampler, SamplerOutput, SamplingMetadata

__all__ = [
    "AttentionMetadata",
    "LlamaForCausalLM",
    "LoadedModel",
    "ModelArchConfig",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "allocate_kv_caches",
    "default_model_path",
    "ensure_hf_folder",
    "kv_cache_bytes_per_block",
    "load_model",
]

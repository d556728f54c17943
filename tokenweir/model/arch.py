"""The model's description, without torch: ModelArchConfig, read from a Hugging Face config.json
(checked, so that a broken one gets an error naming what is wrong), and the KV cache's size per
token and per block, so that a pool can be sized where torch is absent (a simulator, a router).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from tokenweir.checks import is_finite_number, is_integer

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# config.json keys with no sensible default: without one the config describes no model.
_REQUIRED_CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# Sizes config.json may leave out (defaults apply), but which must be positive integers if given.
_OPTIONAL_SIZE_KEYS = ("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window")
# Flags config.json may leave out, but which must be JSON booleans if given.
_FLAG_KEYS = ("tie_word_embeddings", "attention_bias", "mlp_bias", "use_sliding_window")
# The decoder's MLP is SwiGLU: SiLU is the only activation it computes.
_SUPPORTED_ACTIVATIONS = ("silu", "swish")
# Per rotary pair, the divisor of its RoPE frequency, as a GGUF stores Llama 3 scaling (its
# `rope_freqs` tensor; see gguf_conversion.py). Not an HF key: only tokenweir reads it.
ROPE_FREQ_FACTORS_KEY = "tokenweir_rope_freq_factors"

# The dtype names `--dtype` takes (besides "auto"), each with its canonical name.
DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}
_ELEMENT_SIZES = {"float32": 4, "bfloat16": 2, "float16": 2}


class HasItemsize(Protocol):
    """A torch or numpy dtype."""

    @property
    def itemsize(self) -> int: ...


def canonical_dtype(name: str) -> str:
    """"bf16" -> "bfloat16" (also the name of the torch dtype); ValueError for unknown names."""
    try:
        return DTYPE_NAMES[name.lower()]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; use auto or one of {sorted(DTYPE_NAMES)}") from None


def element_size(dtype: str | int | HasItemsize) -> int:
    """Bytes per element of a dtype given by name ("bf16"), by size, or as a torch dtype."""
    if is_integer(dtype):
        return dtype
    if isinstance(dtype, str):
        return _ELEMENT_SIZES[canonical_dtype(dtype.removeprefix("torch."))]
    return int(dtype.itemsize)


@dataclass(frozen=True)
class ModelArchConfig:
    architecture: str  # e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE, else {"rope_type": "linear" | "llama3", "factor": ..., ...}.
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2, Llama with attention_bias)
    o_proj_bias: bool  # Llama's attention_bias also puts one on o_proj; Qwen2's does not
    eos_token_ids: tuple[int, ...]
    # Mistral-style sliding window; None when attention is global.
    sliding_window: int | None = None
    # Per rotary pair, a divisor of its frequency (a GGUF's `rope_freqs`, see llama.rope_inv_freq).
    rope_freq_factors: tuple[float, ...] | None = None

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def max_model_len(self) -> int:
        # Attention here is always global, which equals sliding-window attention as long as
        # no context is longer than the window: cap the usable length there.
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    def kv_bytes_per_token(self, dtype: str | int | HasItemsize) -> int:
        """Bytes one token's K and V take across all layers, at `dtype` (see element_size)."""
        return self.num_hidden_layers * 2 * self.num_key_value_heads * self.head_dim * element_size(dtype)


def kv_cache_bytes_per_block(arch: ModelArchConfig, block_size: int, dtype: str | int | HasItemsize) -> int:
    """Bytes one block takes across all layers (K and V): divide a memory budget by this."""
    return block_size * arch.kv_bytes_per_token(dtype)


# ---------------------------------------------------------------------------------------------
# config.json -> ModelArchConfig


def _rope_settings(cfg: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    # transformers 5 writes "rope_parameters" (theta inside); older files write "rope_theta"
    # and an optional "rope_scaling" whose type key is "rope_type" or, older still, "type".
    params, scaling = cfg.get("rope_parameters"), cfg.get("rope_scaling")
    for key, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{source}: {key} must be an object, got {value!r:.80}")
    params = params or {}
    scaling = scaling or params
    theta = next((t for t in (cfg.get("rope_theta"), params.get("rope_theta"), scaling.get("rope_theta"))
                  if t is not None), 10000.0)
    if not is_finite_number(theta) or theta <= 0:
        raise ValueError(f"{source}: rope_theta must be a positive number, got {theta!r}")
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{source}: unsupported rope type {rope_type!r}; supported: {', '.join(_SUPPORTED_ROPE_TYPES)}"
        )
    if rope_type == "default":
        return float(theta), None
    needed = ["factor"]
    if rope_type == "llama3":
        needed += ["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
    missing = [k for k in needed if k not in scaling]
    if missing:
        raise ValueError(f"{source}: rope scaling {rope_type!r} lacks {', '.join(missing)}")
    # A factor of 0 or below makes NaN rotary tables: every output would be garbage, silently.
    bad = [f"{k}={scaling[k]!r}" for k in needed if not is_finite_number(scaling[k]) or scaling[k] <= 0
           or (k == "original_max_position_embeddings" and not is_integer(scaling[k]))]
    if bad:
        raise ValueError(f"{source}: rope scaling {rope_type!r} needs positive numbers: {', '.join(bad)}")
    if rope_type == "llama3" and not scaling["high_freq_factor"] > scaling["low_freq_factor"]:
        raise ValueError(f"{source}: rope scaling 'llama3' needs high_freq_factor > low_freq_factor, got "
                         f"{scaling['high_freq_factor']!r} and {scaling['low_freq_factor']!r}")
    return float(theta), {"rope_type": rope_type, **{k: scaling[k] for k in needed}}


def _check_config_values(cfg: dict[str, Any], source: str) -> None:
    missing = [k for k in _REQUIRED_CONFIG_KEYS if cfg.get(k) is None]
    if missing:
        raise ValueError(f"{source}: missing required key(s): {', '.join(missing)}")
    sizes = [*_REQUIRED_CONFIG_KEYS, *(k for k in _OPTIONAL_SIZE_KEYS if cfg.get(k) is not None)]
    bad = [f"{k}={cfg[k]!r}" for k in sizes if not is_integer(cfg[k]) or cfg[k] <= 0]
    if bad:
        raise ValueError(f"{source}: expected positive integers: {', '.join(bad)}")
    eps = cfg.get("rms_norm_eps", 1e-6)
    if not is_finite_number(eps) or eps <= 0:
        raise ValueError(f"{source}: rms_norm_eps must be a positive number, got {eps!r}")
    act = cfg.get("hidden_act", "silu")
    if act not in _SUPPORTED_ACTIVATIONS:
        raise ValueError(f"{source}: hidden_act {act!r} is not supported; supported: {', '.join(_SUPPORTED_ACTIVATIONS)}")
    # "false" in quotes is a true value to Python: read as written, it would pick another model.
    bad = [f"{k}={cfg[k]!r}" for k in _FLAG_KEYS if cfg.get(k) is not None and not isinstance(cfg[k], bool)]
    if bad:
        raise ValueError(f"{source}: expected true or false: {', '.join(bad)}")
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise ValueError(f"{source}: num_attention_heads ({heads}) must be a multiple of num_key_value_heads "
                         f"({kv_heads}): each KV head serves a whole group of query heads")


def _rope_freq_factors(cfg: dict[str, Any], head_dim: int, source: str) -> tuple[float, ...] | None:
    factors = cfg.get(ROPE_FREQ_FACTORS_KEY)
    if factors is None:
        return None
    pairs = head_dim // 2
    if not (
        isinstance(factors, list)
        and len(factors) == pairs
        and all(is_finite_number(f) and f > 0 for f in factors)
    ):
        raise ValueError(f"{source}: {ROPE_FREQ_FACTORS_KEY} must list {pairs} positive numbers (one per rotary pair)")
    return tuple(float(f) for f in factors)


def _as_ids(value: Any, vocab_size: int, where: str) -> list[int]:
    if value is None:
        return []
    ids = value if isinstance(value, list) else [value]
    if not all(is_integer(t) and 0 <= t < vocab_size for t in ids):
        raise ValueError(f"{where}: eos_token_id must be a token id or a list of them, each in "
                         f"[0, vocab_size={vocab_size}), got {value!r:.80}")
    return list(ids)


def arch_from_hf_config(
    cfg: dict[str, Any], generation_cfg: dict[str, Any] | None = None, source: str = "config.json"
) -> ModelArchConfig:
    archs = cfg.get("architectures") or []
    supported = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
    if not supported:
        raise ValueError(
            f"{source}: architecture {archs or cfg.get('model_type')!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    architecture = supported[0]
    _check_config_values(cfg, source)
    theta, scaling = _rope_settings(cfg, source)
    heads = cfg["num_attention_heads"]
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // heads
    if head_dim % 2:
        raise ValueError(f"{source}: head_dim must be even (rotary embeddings turn pairs of components), "
                         f"got {head_dim}")
    if cfg.get("mlp_bias"):
        raise ValueError(f"{source}: mlp_bias=true is not supported")
    is_qwen2 = architecture == "Qwen2ForCausalLM"
    bias = True if is_qwen2 else bool(cfg.get("attention_bias", False))
    window = cfg.get("sliding_window")
    if is_qwen2 and not cfg.get("use_sliding_window", False):
        window = None
    # Llama 3 instruct lists its end-of-turn tokens only in generation_config.json.
    eos = _as_ids(cfg.get("eos_token_id"), cfg["vocab_size"], source)
    for tok in _as_ids((generation_cfg or {}).get("eos_token_id"), cfg["vocab_size"], "generation_config.json"):
        if tok not in eos:
            eos.append(tok)
    return ModelArchConfig(
        architecture=architecture,
        vocab_size=cfg["vocab_size"],
        hidden_size=hidden,
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=cfg.get("max_position_embeddings") or 2048,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bias,
        o_proj_bias=bias and not is_qwen2,
        eos_token_ids=tuple(eos),
        sliding_window=window or None,
        rope_freq_factors=_rope_freq_factors(cfg, head_dim, source),
    )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def arch_from_hf_folder(folder: str | Path) -> ModelArchConfig:
    """The description of the model in a Hugging Face folder (config.json, generation_config.json)."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder}: no config.json (expected a Hugging Face model folder)")
    gen_path = folder / "generation_config.json"
    return arch_from_hf_config(
        _read_json(config_path), _read_json(gen_path) if gen_path.is_file() else None, str(config_path)
    )

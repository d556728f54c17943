"""The elementwise pieces of a decoder layer: RMSNorm (with the residual add), RoPE, SwiGLU.

Each runs as one fused C kernel for bf16 on the CPU (`tokenweir.model.kernels`, which rounds
where torch does, so both paths give the same values) and as plain torch ops otherwise (fp32,
CUDA, no compiler). The torch versions follow transformers' numerics: RMSNorm normalises in
float32, casts back, then scales; RoPE is the neox rotate-half form.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from tokenweir.model import kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """RMSNorm of x; with `residual`, first residual += x (in place) and normalise the sum."""
    if kernels.fused_ops_available(x):
        return kernels.rms_norm(x, weight, eps, residual)
    if residual is not None:
        x = residual.add_(x)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] -> [T, I]: silu(gate) * up (SwiGLU)."""
    if kernels.fused_ops_available(gate_up):
        return kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class RotaryEmbedding:
    """One step's RoPE: positions [T] and the model's cos / signed-sin tables [max_pos, head_dim].

    The tables hold sin with the rotate-half sign folded in (cat(-sin_lo, sin_hi)), so that
    x * cos + swap_halves(x) * sin_signed equals transformers' x * cos + rotate_half(x) * sin.
    """

    def __init__(self, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor) -> None:
        self.positions = positions
        self.cos_table = cos_table
        self.sin_table = sin_table
        self._gathered: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def apply_(self, x: torch.Tensor, num_heads: int) -> None:
        """Rotate the first `num_heads` heads of x [T, heads, head_dim] in place."""
        if kernels.fused_ops_available(x):
            kernels.rope_(x, num_heads, self.positions, self.cos_table, self.sin_table)
            return
        if self._gathered is None:  # once per step, shared by all layers
            self._gathered = (self.cos_table[self.positions].unsqueeze(1), self.sin_table[self.positions].unsqueeze(1))
        cos, sin = self._gathered
        heads = x[:, :num_heads]
        half = x.shape[-1] // 2
        swapped = torch.cat((heads[..., half:], heads[..., :half]), dim=-1)
        heads.copy_(heads * cos + swapped * sin)

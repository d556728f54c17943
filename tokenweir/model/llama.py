"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2) with paged attention.

The numerics follow Hugging Face transformers' implementation (RMSNorm in float32, neox-style
rotate-half RoPE, residual order), so that fp32 outputs agree to rounding. For speed the
q/k/v projections are fused into one matmul and gate/up into another, RoPE rotates q and k
together in place, and each residual add is folded into the RMSNorm after it: at 30 layers the
number of ops per layer matters as much as their size. On the CPU in bf16 the elementwise
pieces and attention run as C kernels (`layers.py`, `attention.py`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenweir.model.attention import AttentionMetadata, paged_attention
from tokenweir.model.layers import RotaryEmbedding, rms_norm, silu_and_mul
from tokenweir.model.linear import Linear


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
    bos_token_id: int | None
    # Mistral-style sliding window; None when attention is global.
    sliding_window: int | None = None
    # Per rotary pair, a divisor of its frequency (a GGUF's `rope_freqs`, see rope_inv_freq).
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


def rope_inv_freq(arch: ModelArchConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2] in float32, with per-pair factors, linear or Llama-3 scaling."""
    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if arch.rope_freq_factors is not None:
        # llama.cpp's form of Llama 3 scaling: pair i turns at theta^(-2i/d) / factor_i, before
        # any linear scaling (which commutes with it).
        inv_freq = inv_freq / torch.tensor(arch.rope_freq_factors, dtype=torch.float32)
    scaling = arch.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # Llama 3.1: long wavelengths are slowed down by `factor`, short ones are kept, and the
    # band in between is interpolated smoothly.
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    # Uninitialised: every parameter is overwritten by load_weights.
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        h, d = arch.hidden_size, arch.head_dim
        self.num_heads = arch.num_attention_heads
        self.num_kv_heads = arch.num_key_value_heads
        self.head_dim = d
        self.eps = arch.rms_norm_eps
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * d
        self.input_norm = _param(h, dtype=dtype, device=device)
        self.qkv_weight = _param(qkv_out, h, dtype=dtype, device=device)
        self.qkv_bias = _param(qkv_out, dtype=dtype, device=device) if arch.attention_bias else None
        self.o_weight = _param(h, self.num_heads * d, dtype=dtype, device=device)
        self.o_bias = _param(h, dtype=dtype, device=device) if arch.o_proj_bias else None
        self.post_norm = _param(h, dtype=dtype, device=device)
        self.gate_up_weight = _param(2 * arch.intermediate_size, h, dtype=dtype, device=device)
        self.down_weight = _param(h, arch.intermediate_size, dtype=dtype, device=device)

    def finalize_weights(self) -> None:
        """Wrap the loaded weights for the forward pass, prepacked where that pays.

        A prepacked weight is a copy in another layout: the plain parameter is then released
        (emptied) so that the weights are not held twice.
        """
        linears = {"qkv": ("qkv_weight", "qkv_bias"), "o_proj": ("o_weight", "o_bias"),
                   "gate_up": ("gate_up_weight", None), "down": ("down_weight", None)}
        for name, (weight_name, bias_name) in linears.items():
            weight = getattr(self, weight_name)
            linear = Linear(weight, getattr(self, bias_name) if bias_name else None)
            if linear.packed:
                setattr(self, weight_name, _param(0, dtype=weight.dtype, device=weight.device))
            setattr(self, name, linear)

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RotaryEmbedding,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(previous layer's output, residual stream) -> (this layer's output, residual stream).

        The residual add is folded into the next RMSNorm (in place on `residual`); on the first
        layer `hidden` is the embeddings and `residual` None.
        """
        t = hidden.shape[0]
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if residual is None:
            residual = hidden
            x = rms_norm(hidden, self.input_norm, self.eps)
        else:
            x = rms_norm(hidden, self.input_norm, self.eps, residual)
        qkv = self.qkv(x).view(t, nh + 2 * nkv, d)
        rope.apply_(qkv, nh + nkv)
        attn = paged_attention(qkv[:, :nh], qkv[:, nh : nh + nkv], qkv[:, nh + nkv :], kv_cache, meta)
        x = rms_norm(self.o_proj(attn), self.post_norm, self.eps, residual)
        return self.down(silu_and_mul(self.gate_up(x))), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.arch = arch
        self.dtype = dtype
        self.embed_tokens = _param(arch.vocab_size, arch.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(arch, dtype, device) for _ in range(arch.num_hidden_layers))
        self.norm = _param(arch.hidden_size, dtype=dtype, device=device)
        self.lm_head = (
            self.embed_tokens
            if arch.tie_word_embeddings
            else _param(arch.vocab_size, arch.hidden_size, dtype=dtype, device=device)
        )
        self.lm_head_linear: Linear | None = None  # set once the weights are loaded
        # cos/sin for every position, computed in float32 then cast like HF does.
        freqs = torch.outer(torch.arange(arch.max_position_embeddings, dtype=torch.float32), rope_inv_freq(arch))
        half = freqs.shape[-1]
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin()
        sin[:, :half] = -sin[:, :half]
        self.register_buffer("rope_cos", emb.cos().to(dtype=dtype, device=device), persistent=False)
        self.register_buffer("rope_sin", sin.to(dtype=dtype, device=device), persistent=False)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn_metadata: AttentionMetadata,
        kv_caches: list[torch.Tensor],
    ) -> torch.Tensor:
        """Flattened varlen batch [T] -> final hidden states [T, hidden] (after the last norm)."""
        hidden = F.embedding(input_ids, self.embed_tokens)
        residual = None
        rope = RotaryEmbedding(positions, self.rope_cos, self.rope_sin)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden, residual = layer(hidden, residual, rope, attn_metadata, kv_cache)
        return rms_norm(hidden, self.norm, self.arch.rms_norm_eps, residual)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> logits [N, vocab] in the model dtype, as HF computes them (the sampler
        widens them to float32 where it needs probabilities)."""
        assert self.lm_head_linear is not None, "load_weights first"
        return self.lm_head_linear(hidden)

    @torch.no_grad()
    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy HF-named weights in, fusing q/k/v and gate/up. The loader has checked the names
        and shapes against the config (loader._check_weights); extra entries are not read."""
        if self.lm_head_linear is not None:
            raise RuntimeError("the weights are already loaded (they may have been repacked)")
        arch = self.arch
        take = state_dict.__getitem__

        self.embed_tokens.copy_(take("model.embed_tokens.weight"))
        self.norm.copy_(take("model.norm.weight"))
        if not arch.tie_word_embeddings:
            self.lm_head.copy_(take("lm_head.weight"))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn = [f"{p}self_attn.{n}_proj" for n in ("q", "k", "v")]
            layer.input_norm.copy_(take(p + "input_layernorm.weight"))
            layer.post_norm.copy_(take(p + "post_attention_layernorm.weight"))
            layer.qkv_weight.copy_(torch.cat([take(n + ".weight") for n in attn]))
            if layer.qkv_bias is not None:
                layer.qkv_bias.copy_(torch.cat([take(n + ".bias") for n in attn]))
            layer.o_weight.copy_(take(p + "self_attn.o_proj.weight"))
            if layer.o_bias is not None:
                layer.o_bias.copy_(take(p + "self_attn.o_proj.bias"))
            layer.gate_up_weight.copy_(torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]))
            layer.down_weight.copy_(take(p + "mlp.down_proj.weight"))
        for layer in self.layers:
            layer.finalize_weights()
        self.lm_head_linear = Linear(self.lm_head)

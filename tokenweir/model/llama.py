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

import torch
import torch.nn.functional as F
from torch import nn

from tokenweir.model.arch import ModelArchConfig
from tokenweir.model.attention import AttentionMetadata, paged_attention
from tokenweir.model.layers import RotaryEmbedding, rms_norm, silu_and_mul
from tokenweir.model.linear import Linear


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


@dataclass(frozen=True)
class CheckpointWeight:
    """Where one Hugging Face checkpoint tensor goes in LlamaForCausalLM."""

    param: str  # the model's parameter, e.g. "layers.0.qkv_weight"
    shape: tuple[int, ...]  # the checkpoint tensor's shape, as config.json implies it
    offset: int  # its first row in the parameter (fused parameters stack several tensors)


def checkpoint_weights(arch: ModelArchConfig) -> dict[str, CheckpointWeight]:
    """Every tensor an HF checkpoint of `arch` holds, by name, with its shape and destination.

    As nano-vllm's packed_modules_mapping, this is the one place that names the checkpoint's
    tensors: loading and the loader's check of a checkpoint against config.json both read it.
    """
    h, inter, vocab = arch.hidden_size, arch.intermediate_size, arch.vocab_size
    q, kv = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
    # Per decoder layer: name -> (parameter, shape). A fused parameter takes its tensors' rows in
    # the order listed (q, k, v; gate, up).
    layer = {
        "input_layernorm.weight": ("input_norm", (h,)),
        "post_attention_layernorm.weight": ("post_norm", (h,)),
        "self_attn.q_proj.weight": ("qkv_weight", (q, h)),
        "self_attn.k_proj.weight": ("qkv_weight", (kv, h)),
        "self_attn.v_proj.weight": ("qkv_weight", (kv, h)),
        "self_attn.o_proj.weight": ("o_weight", (h, q)),
        "mlp.gate_proj.weight": ("gate_up_weight", (inter, h)),
        "mlp.up_proj.weight": ("gate_up_weight", (inter, h)),
        "mlp.down_proj.weight": ("down_weight", (h, inter)),
    }
    if arch.attention_bias:
        layer |= {"self_attn.q_proj.bias": ("qkv_bias", (q,)), "self_attn.k_proj.bias": ("qkv_bias", (kv,)),
                  "self_attn.v_proj.bias": ("qkv_bias", (kv,))}
    if arch.o_proj_bias:
        layer["self_attn.o_proj.bias"] = ("o_bias", (h,))
    weights = {"model.embed_tokens.weight": CheckpointWeight("embed_tokens", (vocab, h), 0),
               "model.norm.weight": CheckpointWeight("norm", (h,), 0)}
    if not arch.tie_word_embeddings:
        weights["lm_head.weight"] = CheckpointWeight("lm_head", (vocab, h), 0)
    for i in range(arch.num_hidden_layers):
        rows: dict[str, int] = {}
        for name, (param, shape) in layer.items():
            offset = rows.get(param, 0)
            rows[param] = offset + shape[0]
            weights[f"model.layers.{i}.{name}"] = CheckpointWeight(f"layers.{i}.{param}", shape, offset)
    return weights


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
        """Copy HF-named weights in, each into its parameter's rows (checkpoint_weights). The loader
        has checked the names and shapes against the config; extra entries are not read."""
        if self.lm_head_linear is not None:
            raise RuntimeError("the weights are already loaded (they may have been repacked)")
        for name, weight in checkpoint_weights(self.arch).items():
            param = self.get_parameter(weight.param)
            param[weight.offset : weight.offset + weight.shape[0]].copy_(state_dict[name])
        for layer in self.layers:
            layer.finalize_weights()
        self.lm_head_linear = Linear(self.lm_head)

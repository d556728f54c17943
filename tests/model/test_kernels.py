"""The C kernels (paged attention, K/V writes, fused elementwise ops) equal the pure-torch path."""

from __future__ import annotations

import pytest
import torch

from tokenweir.model import kernels
from tokenweir.model.attention import AttentionMetadata, paged_attention

pytestmark = pytest.mark.skipif(kernels._library() is None, reason="no C compiler to build the kernel")


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [
    (9, 3, 64, 16), (4, 4, 128, 8), (8, 2, 32, 4), (6, 1, 48, 32)])
@pytest.mark.parametrize("shapes", [
    # (query_len, seq_len) per request: a 1 is a decode; q < s a chunk continuing a cached context.
    [(1, 1), (1, 5), (1, 16), (1, 17), (1, 97), (1, 300)],
    [(37, 37), (1, 50), (64, 200), (1, 5), (3, 3), (100, 100), (17, 33)],
], ids=["decodes", "mixed"])
def test_attention_kernel_matches_torch(torch_path, dtype, atol, heads, kv_heads, head_dim, block_size, shapes):
    gen = torch.Generator().manual_seed(1)
    num_blocks = 300
    # Disjoint tables in random order, as the block pool hands them out.
    free = iter(torch.randperm(num_blocks, generator=gen).tolist())
    tables = [[next(free) for _ in range(-(-s // block_size))] for _, s in shapes]
    meta = AttentionMetadata.build([q for q, _ in shapes], [s for _, s in shapes], tables, block_size)
    total = sum(q for q, _ in shapes)
    cache = torch.randn(2, num_blocks, kv_heads, block_size * head_dim, generator=gen).to(dtype)
    # q/k/v as the model passes them: row-strided slices of a fused qkv tensor.
    qkv = torch.randn(total, heads + 2 * kv_heads, head_dim, generator=gen).to(dtype)
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    assert kernels.attention_kernel_available(q.device, q.dtype, head_dim) == (head_dim % 16 == 0)
    kernel_cache, torch_cache = cache.clone(), cache.clone()
    got = paged_attention(q, k, v, kernel_cache, meta)
    expected = torch_path(lambda: paged_attention(q, k, v, torch_cache, meta))
    assert torch.equal(kernel_cache, torch_cache)  # both wrote this step's K/V to the same places
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=atol)


def test_attention_kernel_float_path_for_bf16_matches_torch(torch_path, monkeypatch):
    """CPUs without AVX512-BF16 take the kernel's float path for a bf16 cache: build that variant."""
    variant = kernels.load_library(("-mno-avx512bf16",))
    assert variant is not None
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(3)
    shapes = [(1, 40), (1, 16), (50, 50), (20, 70)]
    free = iter(torch.randperm(100, generator=gen).tolist())
    tables = [[next(free) for _ in range(-(-s // block_size))] for _, s in shapes]
    meta = AttentionMetadata.build([q for q, _ in shapes], [s for _, s in shapes], tables, block_size)
    cache = torch.randn(2, 100, kv_heads, block_size * head_dim, generator=gen).bfloat16()
    qkv = torch.randn(sum(q for q, _ in shapes), heads + 2 * kv_heads, head_dim, generator=gen).bfloat16()
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    expected = torch_path(lambda: paged_attention(q, k, v, cache.clone(), meta))
    monkeypatch.setattr(kernels, "_library", lambda: variant)
    got = paged_attention(q, k, v, cache.clone(), meta)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)


def test_fused_elementwise_ops_equal_the_torch_path(torch_path):
    """bf16 RMSNorm (+ residual), SwiGLU and RoPE kernels round where torch's ops do: equal values."""
    from tokenweir.model.layers import RotaryEmbedding, rms_norm, silu_and_mul

    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(37, 96, generator=gen) * 3).bfloat16()
    residual = torch.randn(37, 96, generator=gen).bfloat16()
    weight = torch.randn(96, generator=gen).bfloat16()
    gate_up = (torch.randn(37, 2 * 80, generator=gen) * 4).bfloat16()
    qkv = torch.randn(37, 7, 32, generator=gen).bfloat16()
    positions = torch.randint(0, 500, (37,), generator=gen)
    cos_table = torch.randn(512, 32, generator=gen).bfloat16()
    sin_table = torch.randn(512, 32, generator=gen).bfloat16()

    def run():
        res = residual.clone()
        normed = rms_norm(x, weight, 1e-5)
        normed_sum = rms_norm(x, weight, 1e-5, res)
        rotated = qkv.clone()
        RotaryEmbedding(positions, cos_table, sin_table).apply_(rotated, 5)
        return normed, normed_sum, res, silu_and_mul(gate_up), rotated

    assert kernels.fused_ops_available(x)
    got = run()
    expected = torch_path(run)
    for name, g, e in zip(["rms_norm", "rms_norm+residual", "residual", "silu_and_mul", "rope"], got, expected):
        # Equal up to the float32 sum order inside the norm (one bf16 ulp at most).
        torch.testing.assert_close(g.float(), e.float(), atol=0, rtol=2 ** -7, msg=name)
    assert torch.equal(got[4][:, 5:], qkv[:, 5:])  # heads past num_heads (v) are untouched


@pytest.mark.parametrize("cols", [1, 15, 16, 37, 49152])
def test_argmax_kernel_matches_torch_including_ties(cols):
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(5, cols, generator=gen).bfloat16()
    x[1, :] = 0.0  # all equal: the first index
    if cols > 20:
        x[2, 3] = x[2, 20] = 100.0  # a tie across vector lanes and chunks
    assert torch.equal(kernels.argmax_rows(x), x.float().argmax(dim=-1))

"""The C decode-attention kernel equals the pure-torch paged attention path."""

from __future__ import annotations

import pytest
import torch

from tokenweir.model import kernels
from tokenweir.model.attention import AttentionMetadata, _decode_attention

pytestmark = pytest.mark.skipif(kernels._library() is None, reason="no C compiler to build the kernel")


@pytest.fixture
def torch_path(monkeypatch):
    """Run the block with the kernel disabled (the torch fallback)."""
    def run(fn):
        monkeypatch.setenv("TOKENWEIR_DISABLE_KERNELS", "1")
        kernels._library.cache_clear()
        try:
            return fn()
        finally:
            monkeypatch.delenv("TOKENWEIR_DISABLE_KERNELS")
            kernels._library.cache_clear()
    return run


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [
    (9, 3, 64, 16), (4, 4, 128, 8), (8, 2, 32, 4), (6, 1, 48, 16)])
def test_kernel_matches_torch(torch_path, dtype, atol, heads, kv_heads, head_dim, block_size):
    gen = torch.Generator().manual_seed(0)
    num_blocks = 200
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    lens = [1, 5, block_size, block_size + 1, 97, 300]
    tables = [torch.randperm(num_blocks, generator=gen)[: -(-n // block_size)].tolist() for n in lens]
    meta = AttentionMetadata.build([1] * len(lens), lens, tables, block_size)
    q = torch.randn(len(lens), heads, head_dim, generator=gen).to(dtype)
    assert kernels.decode_kernel_available(q.device, q.dtype)
    got = _decode_attention(q, cache, meta.decode, meta)
    expected = torch_path(lambda: _decode_attention(q, cache, meta.decode, meta))
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=atol)

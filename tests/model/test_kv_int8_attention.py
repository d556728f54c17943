"""Int8 KV rows: requests whose K/V are int8 with a scale per token and group of channels, inside the model-dtype paged
cache's blocks (layout in tokenweir/model/attention.py), written and attended by the C kernel and
the torch path, beside model-dtype rows of the same step.

The references here are independent of the code under test: the quantisation in float64 from its
definition, the byte positions from the layout, attention as SDPA over the dequantised history.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from tokenweir.model import kernels
from tokenweir.model.attention import AttentionMetadata, int8_block_size, int8_cache, paged_attention, write_kv

needs_kernels = pytest.mark.skipif(kernels._library() is None, reason="no C compiler to build the kernel")


# --- references -------------------------------------------------------------------------------

def ref_group(d: int) -> int:
    """Channels per scale, as the layout defines them: 32 where 32 divides the head, else all."""
    return 32 if d % 32 == 0 else d


def ref_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> int8 values [..., d] and float32 scales [..., groups]."""
    d = x.shape[-1]
    x = x.float().reshape(*x.shape[:-1], d // ref_group(d), ref_group(d))
    scale = (x.double().abs().amax(-1) / 127).float()  # the float nearest max|x| / 127
    ratio = x / torch.where(scale > 0, scale, 1)[..., None]  # the float32 quotient (IEEE division)
    q = torch.round(ratio).clamp(-127, 127).to(torch.int8)  # ties to even
    return q.reshape(*x.shape[:-2], d), scale


def ref_dequantize(x: torch.Tensor) -> torch.Tensor:
    q, scale = ref_quantize(x)
    d = x.shape[-1]
    return q.float() * scale.repeat_interleave(ref_group(d), dim=-1)


def key_positions(d: int, bs: int, off: int) -> torch.Tensor:
    """Element index in a (block, kv head) region of component 0 .. d-1 of the key at offset off."""
    comp = torch.arange(d)
    return (comp // 2) * 2 * bs + 2 * off + comp % 2


def value_positions(d: int, off: int) -> torch.Tensor:
    comp = torch.arange(d)
    return (off // 2) * 2 * d + 2 * comp + off % 2


def ref_write(cache, k, v, slots, bs):
    """Model-dtype K/V of tokens at their slots (-1: skip), element by element."""
    for t, slot in enumerate(slots):
        if slot >= 0:
            block, off = divmod(slot, bs)
            cache[0, block, :, key_positions(k.shape[-1], bs, off)] = k[t]
            cache[1, block, :, value_positions(k.shape[-1], off)] = v[t]


def ref_write_int8(cache, k, v, slots, ibs):
    """Int8 K/V of tokens at their slots (-1: skip) into the cache's bytes."""
    raw = cache.view(torch.int8)  # [2, num_blocks, kvh, R]
    d = k.shape[-1]
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        block, off = divmod(slot, ibs)
        for which, x, pos in ((0, k[t], key_positions(d, ibs, off)), (1, v[t], value_positions(d, off))):
            q, scale = ref_quantize(x)  # [kvh, d], [kvh, groups]
            raw[which, block, :, pos] = q
            for g in range(scale.shape[-1]):  # float32 [groups, ibs] after the values
                at = ibs * d + 4 * (g * ibs + off)
                raw[which, block, :, at : at + 4] = scale[:, g].contiguous().view(torch.int8).view(-1, 4)


def ref_slots(shapes, tables, bs, ibs, int8):
    model, quantised = [], []
    for (qlen, slen), table, is_int8 in zip(shapes, tables, int8):
        size = ibs if is_int8 else bs
        row = [table[p // size] * size + p % size for p in range(slen - qlen, slen)]
        model += [-1] * qlen if is_int8 else row
        quantised += row if is_int8 else [-1] * qlen
    return model, quantised


def ref_attention(q, keys, values):
    """q [L, H, d] the last L tokens of a context keys / values [S, kvh, d] -> [L, H * d], float64."""
    qlen, heads, d = q.shape
    slen = keys.shape[0]
    mask = torch.arange(slen)[None, :] <= torch.arange(slen - qlen, slen)[:, None]
    out = F.scaled_dot_product_attention(q.double().transpose(0, 1)[None], keys.double().transpose(0, 1)[None],
                                         values.double().transpose(0, 1)[None], attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(qlen, heads * d)


# --- a step mixing both kinds of rows -----------------------------------------------------------

def tables_for(shapes, sizes, num_blocks, gen):
    """Disjoint tables in random order, as the block pool hands them out."""
    free = iter(torch.randperm(num_blocks, generator=gen).tolist())
    return [[next(free) for _ in range(-(-s // size))] for (_, s), size in zip(shapes, sizes)]


class MixedStep:
    """Requests (query_len, seq_len, int8) with random K/V histories: the context (all but the
    last query_len tokens) written to a cache by a first step, then q / k / v of this step."""

    def __init__(self, dtype, heads, kv_heads, head_dim, block_size, rows, seed=1, fill=None):
        gen = torch.Generator().manual_seed(seed)
        self.heads, self.kv_heads, self.d, self.bs = heads, kv_heads, head_dim, block_size
        self.ibs = int8_block_size(block_size, head_dim, dtype)
        self.shapes = [(q, s) for q, s, _ in rows]
        self.int8 = [i for _, _, i in rows]
        # Tables long enough for either block size, so that the step can also run with
        # int8_rows=None (every row a model-dtype row).
        size = min(block_size, self.ibs)
        num_blocks = sum(-(-s // size) for _, s in self.shapes) + 7
        self.tables = tables_for(self.shapes, [size] * len(rows), num_blocks, gen)
        self.hist = [torch.randn(s, 2, kv_heads, head_dim, generator=gen).to(dtype) for _, s in self.shapes]
        self.cache = torch.randn(2, num_blocks, kv_heads, block_size * head_dim, generator=gen).to(dtype)
        if fill is not None:  # what slots no request wrote hold
            self.cache.fill_(fill)
        ctx = [(s - q, i) for (q, s), i in zip(self.shapes, self.int8)]
        have = [r for r, (c, _) in enumerate(ctx) if c > 0]
        if have:
            cmeta = self.build([ctx[r][0] for r in have], [ctx[r][0] for r in have], [self.tables[r] for r in have],
                               [ctx[r][1] for r in have])
            kv = torch.cat([self.hist[r][: ctx[r][0]] for r in have])
            write_kv(self.cache, kv[:, 0], kv[:, 1], cmeta.slot_mapping, int8_slot_mapping=cmeta.int8_slot_mapping,
                     int8_block_size=cmeta.int8_block_size)
        # This step's q / k / v as the model passes them: row-strided slices of a fused qkv.
        new = torch.cat([h[s - q :] for h, (q, s) in zip(self.hist, self.shapes)])
        q = torch.randn(new.shape[0], heads, head_dim, generator=gen).to(dtype)
        qkv = torch.cat([q, new[:, 0], new[:, 1]], dim=1)
        self.q, self.k, self.v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
        self.starts = [0]
        for qlen, _ in self.shapes:
            self.starts.append(self.starts[-1] + qlen)

    def build(self, qlens, slens, tables, int8):
        return AttentionMetadata.build(qlens, slens, tables, self.bs, int8_rows=int8, int8_block_size=self.ibs)

    def meta(self, int8=True):
        qlens, slens = [q for q, _ in self.shapes], [s for _, s in self.shapes]
        if not int8:
            return AttentionMetadata.build(qlens, slens, self.tables, self.bs)
        return self.build(qlens, slens, self.tables, self.int8)

    def run(self, int8=True):
        cache = self.cache.clone()
        return paged_attention(self.q, self.k, self.v, cache, self.meta(int8)), cache

    def rows(self, r):
        return slice(self.starts[r], self.starts[r + 1])

    def reference(self, r, quantised):
        """Row r's output over its history, dequantised (as an int8 row stores it) or as is."""
        keys, values = self.hist[r][:, 0].float(), self.hist[r][:, 1].float()
        if quantised:
            keys, values = ref_dequantize(keys), ref_dequantize(values)
        return ref_attention(self.q[self.rows(r)].float(), keys, values)


ROWS = [  # (query_len, seq_len, int8): decodes, chunks over cached context, whole prefills
    (1, 40, False), (1, 70, True), (20, 70, True), (37, 37, True), (17, 33, False), (1, 5, True),
    (1, 1, True), (64, 130, False), (40, 130, True), (1, 97, False), (3, 3, False), (1, 61, True),
]
CONFIGS = [  # heads, kv_heads, head_dim, block_size
    (9, 3, 64, 16),  # SmolLM2-135M: int8 blocks of 28 / 56 tokens, tiles straddle TILE
    (4, 4, 128, 8),
    (6, 1, 48, 32),
    (8, 2, 32, 2),  # int8 blocks of 2 / 6 tokens: the kernel's key-by-key path
    (8, 2, 128, 4),  # 4 scale groups, int8 blocks of 6 / 14: both kernel paths read groups
    (6, 1, 48, 4),  # one group (32 does not divide 48), int8 blocks of 4 (bf16): key by key
]
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


# --- tests ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("block_size, head_dim, dtype, expected", [
    (16, 64, torch.bfloat16, 28), (16, 64, torch.float32, 56), (16, 128, torch.bfloat16, 28),
    (16, 128, torch.float32, 56), (32, 64, torch.bfloat16, 56), (8, 32, torch.bfloat16, 14),
    (2, 64, torch.bfloat16, 2), (2, 64, torch.float32, 6), (16, 48, torch.float16, 28)])
def test_int8_block_size(block_size, head_dim, dtype, expected):
    ibs = int8_block_size(block_size, head_dim, dtype)
    assert ibs == expected
    region, per_token = block_size * head_dim * dtype.itemsize, head_dim + 4 * (head_dim // ref_group(head_dim))
    assert ibs % 2 == 0 and ibs * per_token <= region < (ibs + 2) * per_token


@pytest.mark.parametrize("block_size, head_dim, dtype", [(2, 2, torch.bfloat16), (1, 64, torch.bfloat16)])
def test_int8_block_size_too_small(block_size, head_dim, dtype):
    with pytest.raises(ValueError, match="fewer than 2 int8 tokens"):
        int8_block_size(block_size, head_dim, dtype)


def test_metadata_int8_rows():
    shapes, int8 = [(1, 40), (5, 70), (16, 16), (3, 31), (1, 45)], [False, True, False, True, True]
    bs, ibs = 16, 30
    tables = [[3, 9, 4], [7, 1, 12], [0], [5, 8], [2, 6]]  # row 1: 70 tokens in 3 int8 blocks (not in 3 of 16)
    qlens, slens = [q for q, _ in shapes], [s for _, s in shapes]
    meta = AttentionMetadata.build(qlens, slens, tables, bs, int8_rows=int8, int8_block_size=ibs)
    model, quantised = ref_slots(shapes, tables, bs, ibs, int8)
    assert meta.slot_mapping.tolist() == model
    assert meta.int8_slot_mapping.tolist() == quantised and meta.int8_slot_mapping.dtype == torch.int64
    assert meta.int8_rows.tolist() == [0, 1, 0, 1, 1] and meta.int8_rows.dtype == torch.int32
    assert meta.int8_block_size == ibs
    # The torch path's batches: model-dtype rows in decode / prefills, int8 rows on their own.
    assert meta.decode.tokens == slice(0, 1) and [c.start for c in meta.prefills] == [6]
    assert [(c.start, c.end, c.seq_len, c.block_ids.tolist()) for c in meta.int8_chunks] == [
        (1, 6, 70, [7, 1, 12]), (22, 25, 31, [5, 8]), (25, 26, 45, [2, 6])]
    # No int8 row: exactly the model-dtype metadata.
    plain = AttentionMetadata.build(qlens, slens, [t + [20, 21] for t in tables], bs)
    for flags in (None, [False] * 5):
        same = AttentionMetadata.build(qlens, slens, [t + [20, 21] for t in tables], bs, int8_rows=flags,
                                       int8_block_size=ibs)
        assert same.int8_slot_mapping is None and same.int8_rows is None and same.int8_chunks == []
        # Kept where the engine stores int8 rows at all: the torch decode path then zeroes its padding.
        assert same.int8_block_size == ibs and plain.int8_block_size == 0
        assert torch.equal(same.slot_mapping, plain.slot_mapping)
        assert torch.equal(same.decode.tokens, plain.decode.tokens)  # rows 0 and 4
        assert [c.start for c in same.prefills] == [1, 6, 22]


def test_metadata_bad_int8_input():
    args = ([1, 2], [5, 40], [[0], [1, 2]], 16)
    with pytest.raises(ValueError, match="int8_rows needs int8_block_size >= 2"):
        AttentionMetadata.build(*args, int8_rows=[False, True])
    with pytest.raises(ValueError, match="int8_rows needs int8_block_size >= 2"):
        AttentionMetadata.build(*args, int8_rows=[False, True], int8_block_size=1)
    with pytest.raises(ValueError, match="int8_rows has 1 entries for 2 requests"):
        AttentionMetadata.build(*args, int8_rows=[True], int8_block_size=30)
    with pytest.raises(ValueError, match="request 1: 1 int8 blocks of 30 cannot hold 40 tokens"):
        AttentionMetadata.build([1, 2], [5, 40], [[0], [1]], 16, int8_rows=[False, True], int8_block_size=30)
    with pytest.raises(ValueError, match="request 0: 1 blocks cannot hold 20 tokens"):
        AttentionMetadata.build([1, 2], [20, 30], [[0], [1]], 16, int8_rows=[False, True], int8_block_size=30)


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim, block_size", [(64, 16), (64, 2), (24, 16)])
def test_write_kv_int8(torch_path, path, dtype, head_dim, block_size):
    """Int8 rows' tokens land quantised in their blocks, model-dtype rows' as before; nothing else moves."""
    if path == "kernel" and (kernels._library() is None or head_dim % 16):
        pytest.skip("the kernel takes head_dim a multiple of 16")
    gen = torch.Generator().manual_seed(5)
    kvh, ibs = 3, int8_block_size(block_size, head_dim, dtype)
    shapes, int8 = [(1, 40), (5, 70), (1, 33), (16, 16), (31, 31), (1, 1)], [False, True, True, False, True, True]
    sizes = [ibs if i else block_size for i in int8]
    num_blocks = sum(-(-s // b) for (_, s), b in zip(shapes, sizes)) + 5
    tables = tables_for(shapes, sizes, num_blocks, gen)
    meta = AttentionMetadata.build([q for q, _ in shapes], [s for _, s in shapes], tables, block_size,
                                   int8_rows=int8, int8_block_size=ibs)
    total = sum(q for q, _ in shapes)
    qkv = (torch.randn(total, 4 + 2 * kvh, head_dim, generator=gen) * torch.rand(total, 1, 1, generator=gen) * 8)
    qkv = qkv.to(dtype)
    k, v = qkv[:, 4 : 4 + kvh], qkv[:, 4 + kvh :]
    k[1, 2] = 0  # an int8 row's zero key: scale 0, values 0
    cache = torch.randn(2, num_blocks, kvh, block_size * head_dim, generator=gen).to(dtype)

    expected = cache.clone()
    model, quantised = ref_slots(shapes, tables, block_size, ibs, int8)
    ref_write(expected, k, v, model, block_size)
    ref_write_int8(expected, k, v, quantised, ibs)

    got = cache.clone()
    def write():
        write_kv(got, k, v, meta.slot_mapping, int8_slot_mapping=meta.int8_slot_mapping, int8_block_size=ibs)
    write() if path == "kernel" else torch_path(write)
    want, have = expected.view(torch.int8), got.view(torch.int8)
    # Every byte: int8 values and scales exactly the reference's (both paths divide as IEEE
    # does, rounding ties included), model-dtype slots as before, all else untouched.
    assert torch.equal(have, want), f"{int((have != want).sum())} bytes differ"
    block, off = divmod(quantised[1], ibs)  # the zero key
    assert not have[0, block, 2, key_positions(head_dim, ibs, off)].any()
    at = ibs * head_dim + 4 * off
    assert have[0, block, 2, at : at + 4].contiguous().view(torch.float32).item() == 0
    assert have[0, block, 1, at : at + 4].contiguous().view(torch.float32).item() > 0


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", CONFIGS)
def test_mixed_step_kernel(torch_path, dtype, heads, kv_heads, head_dim, block_size):
    step = MixedStep(dtype, heads, kv_heads, head_dim, block_size, ROWS)
    got, cache = step.run()
    plain, plain_cache = step.run(int8=False)
    fallback, _ = torch_path(step.run)
    tol = TOL[dtype]
    for r, is_int8 in enumerate(step.int8):
        rows = step.rows(r)
        if is_int8:
            torch.testing.assert_close(got[rows].double(), step.reference(r, quantised=True), atol=tol, rtol=tol,
                                       msg=f"row {r}")
        else:
            # Model-dtype rows: bit for bit what they were in a step without int8 rows.
            assert torch.equal(got[rows], plain[rows]), f"row {r}"
            blocks = step.tables[r][: -(-step.shapes[r][1] // block_size)]
            assert torch.equal(cache[:, blocks], plain_cache[:, blocks])
        # The torch fallback agrees, int8 rows included.
        torch.testing.assert_close(fallback[rows].float(), got[rows].float(), atol=tol, rtol=tol, msg=f"row {r}")


@needs_kernels
def test_mixed_step_kernel_float_path_for_bf16(monkeypatch):
    """CPUs without AVX512-BF16: bf16 rows take the float path beside the int8 rows."""
    variant = kernels.load_library(("-mno-avx512bf16",))
    assert variant is not None
    step = MixedStep(torch.bfloat16, 9, 3, 64, 16, ROWS, seed=2)
    expected, _ = step.run()
    monkeypatch.setattr(kernels, "_library", lambda: variant)
    got, _ = step.run()
    for r, is_int8 in enumerate(step.int8):
        if is_int8:  # the same float path either way
            assert torch.equal(got[step.rows(r)], expected[step.rows(r)]), f"row {r}"
        torch.testing.assert_close(got[step.rows(r)].double(), step.reference(r, quantised=is_int8), atol=2e-2,
                                   rtol=2e-2, msg=f"row {r}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [(9, 3, 64, 16), (4, 2, 24, 8)])
def test_mixed_step_torch_path(torch_path, dtype, heads, kv_heads, head_dim, block_size):
    """The fallback alone (head_dim 24: also where the kernel would not run), against the references."""
    step = torch_path(lambda: MixedStep(dtype, heads, kv_heads, head_dim, block_size, ROWS, seed=3))
    got, _ = torch_path(step.run)
    for r, is_int8 in enumerate(step.int8):
        torch.testing.assert_close(got[step.rows(r)].double(), step.reference(r, quantised=is_int8), atol=2e-2,
                                   rtol=2e-2, msg=f"row {r}")
    if dtype == torch.float32:  # dequantised to q's dtype: exact enough to compare closely
        for r in (r for r, i in enumerate(step.int8) if i):
            torch.testing.assert_close(got[step.rows(r)].double(), step.reference(r, quantised=True), atol=1e-5,
                                       rtol=1e-5, msg=f"row {r}")


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_rows_close_to_unquantised(dtype):
    step = MixedStep(dtype, 9, 3, 64, 16, ROWS, seed=4)
    got, _ = step.run()
    for r in (r for r, i in enumerate(step.int8) if i):
        exact = step.reference(r, quantised=False)
        err = (got[step.rows(r)].double() - exact).norm() / exact.norm()
        assert 0 < err < 0.02, f"row {r}: relative error {err:.4f}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_non_finite_token_reads_back_as_nan_on_both_paths(torch_path, dtype):
    """A K/V group with a NaN or inf (the model overflowed) is stored as a NaN scale over zeros by
    the C writer and the torch path alike (a NaN cast to int8 is undefined in C), so it reads
    back as NaN, as it would in the model's dtype; the other tokens are quantised as usual."""
    d, kvh, bs = 64, 2, 16
    ibs = int8_block_size(bs, d, dtype)
    k = torch.randn(3, kvh, d)
    k[1, 0, 5], k[2, 1, 7] = float("nan"), float("inf")
    k, v = k.to(dtype), torch.randn(3, kvh, d).to(dtype)
    slots, int8_slots = torch.full((3,), -1, dtype=torch.int64), torch.tensor([0, 1, ibs + 2])
    caches = []
    for path in (["kernel"] if kernels._library() is not None else []) + ["torch"]:
        cache = torch.zeros(2, 2, kvh, bs * d, dtype=dtype)
        write = lambda: write_kv(cache, k, v, slots, int8_slot_mapping=int8_slots, int8_block_size=ibs)  # noqa: E731
        write() if path == "kernel" else torch_path(write)
        keys, _, key_scales, value_scales = int8_cache(cache, d, ibs)
        # Token 1's head 0 held the NaN (channel 5), token 2's head 1 the inf (channel 7): the
        # first group of 32 channels of those heads' keys (component pairs 0..15), only.
        assert torch.isnan(key_scales[0, 0, 0, 1]) and torch.isnan(key_scales[1, 1, 0, 2])
        assert keys[0, 0, :16, 1].eq(0).all() and keys[1, 1, :16, 2].eq(0).all()
        assert torch.isfinite(key_scales[0, 0, 1, 1]) and keys[0, 0, 16:, 1].ne(0).any()
        assert torch.isfinite(key_scales[0, :, :, 0]).all() and torch.isfinite(key_scales[0, 1, :, 1]).all()
        assert torch.isfinite(value_scales[0, :, :, :2]).all() and keys[0, 1, :, 1].ne(0).any()
        caches.append(cache.view(torch.uint8))
    if len(caches) == 2:
        assert torch.equal(caches[0], caches[1])


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unwritten_slots_are_never_attended(torch_path, path, dtype):
    """A block's slots past its request's context may hold anything, e.g. an int8 row's bytes
    read as floats (NaN, inf): neither path may let them into an output (the torch path's
    padded decode batch masks them, which alone does not cancel a NaN)."""
    if path == "kernel" and kernels._library() is None:
        pytest.skip("no C compiler to build the kernel")
    run = (lambda fn: fn()) if path == "kernel" else torch_path
    step = run(lambda: MixedStep(dtype, 9, 3, 64, 16, ROWS, seed=5, fill=float("nan")))
    got, _ = run(step.run)
    for r, is_int8 in enumerate(step.int8):
        torch.testing.assert_close(got[step.rows(r)].double(), step.reference(r, quantised=is_int8), atol=2e-2,
                                   rtol=2e-2, msg=f"row {r}")

"""Paged attention: the KV cache layout, the step's attention metadata, and attention itself.

One step's inputs are a flattened varlen batch: the scheduled tokens of all requests
concatenated. Each layer writes its new K/V into the paged cache and then lets every
request's queries attend over that request's whole context, read through its block table.

On the CPU one C kernel (`tokenweir.model.kernels`) does this for all requests of the step at
once, decodes and prefill chunks alike, straight from the paged cache. Elsewhere (CUDA), or
without a C compiler, torch does it: decodes in a single SDPA call over a padded batch, each
prefill chunk in its own call. Everything that depends only on the step (index tensors, masks)
is computed once in `AttentionMetadata.build`, not in each of the model's layers.

Cache layout: one tensor per layer, [2, num_blocks, kv_heads, block_size * head_dim]. Within a
block, each KV head's keys are stored transposed in component pairs, [head_dim / 2, block_size, 2]
(key t's components 2i and 2i+1 side by side), and its values in key pairs,
[block_size / 2, head_dim, 2] (component d of keys 2m and 2m+1 side by side): the kernel then
reads, for every pair of components, one contiguous run of keys, and for every pair of keys one
contiguous run of components, in the operand order of bf16 dot-product instructions (see
paged_attention.c). Block sizes must be even. `key_cache` / `value_cache` give the two views.

Int8 rows: a request may keep its K/V as int8 instead (`AttentionMetadata.build(int8_rows=...)`),
in the same tensor and blocks, each (block, kv head) region of K (and of V) of
R = block_size * head_dim * element_size bytes reinterpreted. Its channels are quantised in
groups of G = `int8_scale_group(head_dim)` (32, or the whole head where 32 does not divide it),
each with a float32 scale. Such a block holds ibs = `int8_block_size(...)` tokens, the largest
even n with n * (head_dim + 4 * head_dim / G) <= R (bf16, block 16, head_dim 64: 28). Bytes
[0, ibs * head_dim) hold the int8 values in the pair layouts above with ibs for block_size (keys
[head_dim / 2, ibs, 2], values [ibs / 2, head_dim, 2]); then the scales, float32
[head_dim / G, ibs] (group, then token), the keys' in the K region and the values' in the V
region. Quantisation is symmetric, per token, kv head and group, for K and V apart: scale =
max |x| / 127 over the group's components (0 for a zero group, then all its values 0), q = x /
scale rounded to nearest and clamped to [-127, 127], read back as q * scale. An int8 row's slot of
position p is table[p // ibs] * ibs + p % ibs: its block table counts blocks of ibs tokens.
`int8_cache` gives the views.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokenweir.core.kv_cache_manager import int8_scale_group, int8_tokens_per_block
from tokenweir.model import kernels
from tokenweir.model.arch import ModelArchConfig


def int8_block_size(block_size: int, head_dim: int, dtype: torch.dtype) -> int:
    """Tokens an int8 row keeps per block of a `dtype` cache (layout above)."""
    return int8_tokens_per_block(block_size, head_dim, dtype.itemsize)


def int8_cache(
    kv_cache: torch.Tensor, head_dim: int, ibs: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Int8 views of a layer's cache with ibs tokens per block: keys
    [num_blocks, kv_heads, head_dim / 2, ibs, 2], values [num_blocks, kv_heads, ibs / 2, head_dim, 2]
    (int8), and their scales, each [num_blocks, kv_heads, groups, ibs] (float32)."""
    _, num_blocks, kvh, _ = kv_cache.shape
    raw = kv_cache.view(torch.int8)  # [2, num_blocks, kvh, R]
    n, groups = ibs * head_dim, head_dim // int8_scale_group(head_dim)
    scales = raw[..., n : n + 4 * groups * ibs].view(torch.float32).view(2, num_blocks, kvh, groups, ibs)
    return (raw[0, ..., :n].view(num_blocks, kvh, head_dim // 2, ibs, 2),
            raw[1, ..., :n].view(num_blocks, kvh, ibs // 2, head_dim, 2), scales[0], scales[1])


def key_cache(kv_cache: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The layer's keys as [num_blocks, kv_heads, head_dim / 2, block_size, 2]."""
    _, num_blocks, kvh, width = kv_cache.shape
    return kv_cache[0].view(num_blocks, kvh, head_dim // 2, width // head_dim, 2)


def value_cache(kv_cache: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The layer's values as [num_blocks, kv_heads, block_size / 2, head_dim, 2]."""
    _, num_blocks, kvh, width = kv_cache.shape
    return kv_cache[1].view(num_blocks, kvh, width // head_dim // 2, head_dim, 2)


@dataclass
class DecodeBatch:
    """All one-token queries of the step, for the torch path's single padded SDPA call."""

    # Where the decode tokens lie in the flattened batch: a slice when they are contiguous
    # (the common layout), else an index tensor.
    tokens: slice | torch.Tensor
    # Flat block ids [num_decodes * num_blocks]: row r's padded block table, gathered with one
    # index_select (far faster on CPU than advanced indexing with a 2-D index).
    block_ids: torch.Tensor
    num_blocks: int
    max_seq_len: int
    # True where a key position lies inside the request's context, [num_decodes, 1, 1, S].
    key_mask: torch.Tensor
    # Its complement as [num_decodes, 1, S, 1], to zero the padding keys and values (below).
    padding: torch.Tensor


@dataclass
class PrefillChunk:
    """One request's chunk of several query tokens, or an int8 row's queries (torch path)."""

    start: int
    end: int
    seq_len: int
    # None when the chunk is the request's whole context so far (model-dtype rows only): it then
    # attends to its own fresh K/V with a plain causal mask, without reading the cache.
    block_ids: torch.Tensor | None
    # Causal mask with offset [query_len, seq_len] (True = attend), when block_ids is set.
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [T]: cache slot of each new token's K/V
    query_start_loc: torch.Tensor  # int32 [B+1]
    query_lens: torch.Tensor  # int32 [B]
    seq_lens: torch.Tensor  # int32 [B]: context length including this step's tokens
    block_tables: torch.Tensor  # int32 [B, max_blocks_per_seq], padded with 0
    block_size: int
    # The step as lists, from which the torch path's structures are built on first use only:
    # the C kernel needs none of them.
    _starts: list[int] = field(repr=False)
    _seq_lens: list[int] = field(repr=False)
    _tables: list[list[int]] = field(repr=False)
    # Int8 rows (layout in the module doc); None when the step has none. slot_mapping then holds
    # -1 for their tokens, int8_slot_mapping (int64 [T], slots by int8_block_size) -1 for the
    # others'. int8_block_size is set whenever the engine stores int8 rows (0: it never does).
    int8_slot_mapping: torch.Tensor | None = None
    int8_rows: torch.Tensor | None = None  # int32 [B]: 1 for an int8 row
    int8_block_size: int = 0
    _int8: list[bool] | None = field(default=None, repr=False)
    # Masks converted to the model's dtype, filled on first use: SDPA wants a float mask in
    # the query's dtype, and the dtype is a property of the model, not of the step.
    _float_masks: dict[tuple[int, torch.dtype], torch.Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        *,
        int8_rows: list[bool] | None = None,
        int8_block_size: int = 0,
    ) -> AttentionMetadata:
        """int8_rows: which requests keep their K/V as int8, with int8_block_size
        (`int8_block_size(...)`) tokens per block; their tables count blocks of that size."""
        if not query_lens or not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables need one entry per request (at least one)")
        if int8_rows is not None:
            if len(int8_rows) != len(query_lens):
                raise ValueError(f"int8_rows has {len(int8_rows)} entries for {len(query_lens)} requests")
            if int8_block_size < 2:
                raise ValueError(f"int8_rows needs int8_block_size >= 2 (tokens per int8 block), got {int8_block_size}")
            int8_rows = [bool(i) for i in int8_rows] if any(int8_rows) else None
            # (None: the model-dtype step, though int8_block_size is kept: see _decode_attention)
        slots: list[int] = []
        int8_slots: list[int] = []
        starts = [0]
        for r, (qlen, slen, table) in enumerate(zip(query_lens, seq_lens, block_tables)):
            if qlen < 1 or slen < qlen:
                raise ValueError(f"request {r}: query_len {qlen} and seq_len {slen} are inconsistent")
            is_int8 = int8_rows is not None and int8_rows[r]
            bs = int8_block_size if is_int8 else block_size
            if len(table) * bs < slen:
                kind = f"int8 blocks of {bs}" if is_int8 else "blocks"
                raise ValueError(f"request {r}: {len(table)} {kind} cannot hold {slen} tokens")
            row = [table[p // bs] * bs + p % bs for p in range(slen - qlen, slen)]
            if int8_rows is None:
                slots += row
            elif is_int8:
                slots += [-1] * qlen
                int8_slots += row
            else:
                slots += row
                int8_slots += [-1] * qlen
            starts.append(starts[-1] + qlen)

        max_blocks = max(len(t) for t in block_tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            query_lens=torch.tensor(query_lens, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            block_size=block_size,
            _starts=starts,
            _seq_lens=list(seq_lens),
            _tables=block_tables,
            int8_block_size=int8_block_size,
            **({} if int8_rows is None else dict(
                int8_slot_mapping=torch.tensor(int8_slots, dtype=torch.int64, device=device),
                int8_rows=torch.tensor(int8_rows, dtype=torch.int32, device=device),
                _int8=int8_rows,
            )),
        )

    def _model_dtype_row(self, r: int) -> bool:
        return self._int8 is None or not self._int8[r]

    @functools.cached_property
    def decode(self) -> DecodeBatch | None:
        """The step's one-token queries of model-dtype rows, for the torch path."""
        rows = [r for r in range(len(self._seq_lens))
                if self._starts[r + 1] - self._starts[r] == 1 and self._model_dtype_row(r)]
        return _decode_batch(rows, self._starts, self._seq_lens, self._tables, self.block_size,
                             self.slot_mapping.device)

    @functools.cached_property
    def prefills(self) -> list[PrefillChunk]:
        """The step's multi-token chunks of model-dtype rows, for the torch path."""
        return [_prefill_chunk(self._starts[r], self._starts[r + 1] - self._starts[r], slen, table,
                               self.block_size, self.slot_mapping.device)
                for r, (slen, table) in enumerate(zip(self._seq_lens, self._tables))
                if self._starts[r + 1] - self._starts[r] > 1 and self._model_dtype_row(r)]

    @functools.cached_property
    def int8_chunks(self) -> list[PrefillChunk]:
        """The int8 rows, decodes and chunks alike, each attended on its own by the torch path.
        Always through the cache (block_ids set), also for a whole-context chunk: its keys are
        the dequantised ones, as the kernel's."""
        if self._int8 is None:
            return []
        return [_prefill_chunk(self._starts[r], self._starts[r + 1] - self._starts[r], slen, table,
                               self.int8_block_size, self.slot_mapping.device, from_cache=True)
                for r, (slen, table) in enumerate(zip(self._seq_lens, self._tables)) if self._int8[r]]

    def float_mask(self, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        key = (id(mask), dtype)
        cached = self._float_masks.get(key)
        if cached is None:
            cached = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
            self._float_masks[key] = cached
        return cached


def _prefill_chunk(
    start: int, qlen: int, slen: int, table: list[int], block_size: int, device: torch.device | str,
    from_cache: bool = False,
) -> PrefillChunk:
    if qlen == slen and not from_cache:
        return PrefillChunk(start, start + qlen, slen, None, None)
    nblocks = -(-slen // block_size)
    offset = slen - qlen
    # Query i sits at position offset + i and sees keys at positions <= offset + i.
    key_pos = torch.arange(slen, device=device)
    query_pos = torch.arange(offset, slen, device=device)
    mask = key_pos[None, :] <= query_pos[:, None]
    block_ids = torch.tensor(table[:nblocks], dtype=torch.int64, device=device)
    return PrefillChunk(start, start + qlen, slen, block_ids, mask)


def _decode_batch(
    rows: list[int],
    starts: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str,
) -> DecodeBatch | None:
    if not rows:
        return None
    token_idx = [starts[r] for r in rows]
    contiguous = token_idx == list(range(token_idx[0], token_idx[0] + len(token_idx)))
    tokens = (
        slice(token_idx[0], token_idx[0] + len(token_idx))
        if contiguous
        else torch.tensor(token_idx, dtype=torch.int64, device=device)
    )
    lens = [seq_lens[r] for r in rows]
    max_len = max(lens)
    nblocks = -(-max_len // block_size)
    # Pad short tables with block 0: its keys are masked out below, so any block will do.
    flat: list[int] = []
    for r in rows:
        table = block_tables[r][:nblocks]
        flat += table + [0] * (nblocks - len(table))
    lens_tensor = torch.tensor(lens, dtype=torch.int32, device=device)
    key_mask = torch.arange(max_len, device=device)[None, :] < lens_tensor[:, None]
    return DecodeBatch(
        tokens=tokens,
        block_ids=torch.tensor(flat, dtype=torch.int64, device=device),
        num_blocks=nblocks,
        max_seq_len=max_len,
        key_mask=key_mask[:, None, None, :],
        padding=~key_mask[:, None, :, None],
    )


def write_kv(
    kv_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    int8_slot_mapping: torch.Tensor | None = None,
    int8_block_size: int = 0,
) -> None:
    """Store this step's K/V [T, kv_heads, head_dim] at their slots of a layer's cache: at
    slot_mapping in the model dtype, at int8_slot_mapping (if given) quantised to int8; a -1 in
    one skips the token there."""
    d = k.shape[-1]
    if kernels.attention_kernel_available(k.device, k.dtype, d):
        kernels.write_kv_cache(k, v, slot_mapping, kv_cache)
        if int8_slot_mapping is not None:
            kernels.write_kv_cache(k, v, int8_slot_mapping, kv_cache, int8_block_size)
        return
    if int8_slot_mapping is not None:
        # -1 would index the last block: keep the tokens that have a slot.
        mine = (slot_mapping >= 0).nonzero().squeeze(1)
        k8, v8 = k, v
        k, v, slot_mapping = k[mine], v[mine], slot_mapping[mine]
    block_size = kv_cache.shape[3] // d
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    key_cache(kv_cache, d)[blocks, :, :, offsets, :] = k.reshape(k.shape[0], k.shape[1], d // 2, 2)
    value_cache(kv_cache, d)[blocks, :, offsets // 2, :, offsets % 2] = v
    if int8_slot_mapping is not None:
        _write_kv_int8(kv_cache, k8, v8, int8_slot_mapping, int8_block_size)


def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] -> int8 values [..., d] and float32 scales [..., groups] (module doc)."""
    d = x.shape[-1]
    grouped = x.float().reshape(*x.shape[:-1], d // int8_scale_group(d), int8_scale_group(d))
    scale = grouped.abs().amax(-1) / 127
    # A zero scale has a zero group (or one too small for a float scale): dividing by 1 keeps it 0.
    q = torch.round(grouped / torch.where(scale > 0, scale, 1)[..., None]).clamp_(-127, 127)
    # A group with a NaN or inf (the model overflowed) reads back as NaN, as in the model's dtype:
    # a NaN scale over zeros, as the C writer stores it.
    finite = torch.isfinite(grouped).all(-1)
    q = q.masked_fill_(~finite[..., None], 0).to(torch.int8).reshape(x.shape)
    return q, scale.masked_fill_(~finite, float("nan"))


def _write_kv_int8(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, ibs: int) -> None:
    mine = (slots >= 0).nonzero().squeeze(1)
    k, v, slots = k[mine], v[mine], slots[mine]
    d = k.shape[-1]
    keys, values, key_scales, value_scales = int8_cache(kv_cache, d, ibs)
    blocks, offsets = slots // ibs, slots % ibs
    qk, sk = _quantize(k)
    qv, sv = _quantize(v)
    keys[blocks, :, :, offsets, :] = qk.view(qk.shape[0], qk.shape[1], d // 2, 2)
    values[blocks, :, offsets // 2, :, offsets % 2] = qv
    key_scales[blocks, :, :, offsets] = sk  # [T, kvh, groups]
    value_scales[blocks, :, :, offsets] = sv


def _gather_context(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, blocks_per_seq: int, seq_len: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of requests through their flattened block tables: each [num_seqs, kvh, seq_len, d]."""
    keys = torch.index_select(key_cache(kv_cache, head_dim), 0, block_ids)  # [n * nb, kvh, d / 2, bs, 2]
    values = torch.index_select(value_cache(kv_cache, head_dim), 0, block_ids)  # [n * nb, kvh, bs / 2, d, 2]
    kvh, bs = kv_cache.shape[2], kv_cache.shape[3] // head_dim
    keys = keys.view(-1, blocks_per_seq, kvh, head_dim // 2, bs, 2).permute(0, 2, 1, 4, 3, 5)
    values = values.view(-1, blocks_per_seq, kvh, bs // 2, head_dim, 2).permute(0, 2, 1, 3, 5, 4)
    shape = (keys.shape[0], kvh, blocks_per_seq * bs, head_dim)
    return keys.reshape(shape)[:, :, :seq_len], values.reshape(shape)[:, :, :seq_len]


def _gather_int8_context(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int, head_dim: int, ibs: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 row's K and V through its block table, dequantised to `dtype`: each [1, kvh, seq_len, d]."""
    keys, values, key_scales, value_scales = int8_cache(kv_cache, head_dim, ibs)
    nb, kvh = block_ids.shape[0], kv_cache.shape[2]
    group = int8_scale_group(head_dim)
    # Each component's scale: [nb, kvh, d / 2, ibs] per key pair of components, [nb, kvh, d, ibs].
    ks = torch.index_select(key_scales, 0, block_ids).repeat_interleave(group // 2, dim=2)
    vs = torch.index_select(value_scales, 0, block_ids).repeat_interleave(group, dim=2)
    keys = torch.index_select(keys, 0, block_ids).float() * ks[..., None]  # [nb, kvh, d / 2, ibs, 2]
    values = (torch.index_select(values, 0, block_ids).float()
              * vs.view(nb, kvh, head_dim, ibs // 2, 2).transpose(2, 3))  # [nb, kvh, ibs / 2, d, 2]
    keys = keys.permute(1, 0, 3, 2, 4).reshape(1, kvh, nb * ibs, head_dim)
    values = values.permute(1, 0, 2, 4, 3).reshape(1, kvh, nb * ibs, head_dim)
    return keys[:, :, :seq_len].to(dtype), values[:, :, :seq_len].to(dtype)


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    """q [T, H, d], k/v [T, kvh, d] of this step -> attention output [T, H * d].

    Writes k/v into `kv_cache` first, so that each query also sees its own and earlier tokens
    of this step.
    """
    write_kv(kv_cache, k, v, meta.slot_mapping, int8_slot_mapping=meta.int8_slot_mapping,
             int8_block_size=meta.int8_block_size)
    num_tokens, num_heads, d = q.shape
    if kernels.attention_kernel_available(q.device, q.dtype, d):
        out = kernels.paged_attention(q, kv_cache, meta.block_tables, meta.query_start_loc, meta.query_lens,
                                      meta.seq_lens, d**-0.5, meta.int8_rows, meta.int8_block_size)
        return out.view(num_tokens, num_heads * d)

    decode = meta.decode
    int8_chunks = meta.int8_chunks
    if decode is not None and not meta.prefills and not int8_chunks:
        # Pure decode step: the decode tokens are the whole batch, in order.
        return _decode_attention(q, kv_cache, decode, meta)
    out = q.new_empty(num_tokens, num_heads * d)
    if decode is not None:
        out[decode.tokens] = _decode_attention(q[decode.tokens], kv_cache, decode, meta)
    for chunk in meta.prefills:
        out[chunk.start : chunk.end] = _prefill_attention(q, k, v, kv_cache, chunk, meta)
    for chunk in int8_chunks:
        out[chunk.start : chunk.end] = _prefill_attention(q, k, v, kv_cache, chunk, meta, int8=True)
    return out


def _decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, decode: DecodeBatch, meta: AttentionMetadata
) -> torch.Tensor:
    num_seqs, num_heads, d = q.shape
    kvh = kv_cache.shape[2]
    # GQA without repeating K/V: the query heads sharing a KV head become that head's rows
    # (HF maps query head h to KV head h // group, so a plain view groups them right). All
    # rows of one request sit at the same position, so only key padding needs masking.
    qg = q.reshape(num_seqs, kvh, num_heads // kvh, d)
    k, v = _gather_context(kv_cache, decode.block_ids, decode.num_blocks, decode.max_seq_len, d)
    if meta.int8_block_size:
        # The padding reads slots no request wrote, which may hold an int8 row's bytes (now or
        # before the block was freed): as floats those can be NaN or inf, which the -inf mask
        # does not cancel (NaN + -inf, 0 * inf). Zeros change nothing else. An engine that
        # never stores int8 rows has only floats there and skips the pass.
        k, v = k.masked_fill(decode.padding, 0), v.masked_fill(decode.padding, 0)
    mask = meta.float_mask(decode.key_mask, q.dtype)
    out = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask)
    return out.reshape(num_seqs, num_heads * d)


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    chunk: PrefillChunk,
    meta: AttentionMetadata,
    int8: bool = False,
) -> torch.Tensor:
    qc = q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)  # [1, H, L, d]
    if int8:
        assert chunk.block_ids is not None and chunk.mask is not None
        kc, vc = _gather_int8_context(kv_cache, chunk.block_ids, chunk.seq_len, q.shape[-1],
                                      meta.int8_block_size, q.dtype)
        mask = meta.float_mask(chunk.mask, q.dtype)
        out = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, enable_gqa=True)
    elif chunk.block_ids is None:
        kc = k[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
        vc = v[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, enable_gqa=True)
    else:
        kc, vc = _gather_context(kv_cache, chunk.block_ids, chunk.block_ids.shape[0], chunk.seq_len, q.shape[-1])
        mask = meta.float_mask(chunk.mask, q.dtype)
        out = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(chunk.end - chunk.start, -1)


def allocate_kv_caches(
    arch: ModelArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
) -> list[torch.Tensor]:
    """One [2, num_blocks, kv_heads, block_size * head_dim] tensor per layer (layout above)."""
    if block_size % 2:
        raise ValueError(f"block_size must be even for the paged KV cache layout, got {block_size}")
    shape = (2, num_blocks, arch.num_key_value_heads, block_size * arch.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_hidden_layers)]

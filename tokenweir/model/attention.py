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
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokenweir.model import kernels
from tokenweir.model.arch import ModelArchConfig


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


@dataclass
class PrefillChunk:
    """One request's chunk of several query tokens (torch path)."""

    start: int
    end: int
    seq_len: int
    # None when the chunk is the request's whole context so far: it then attends to its own
    # fresh K/V with a plain causal mask, without reading the cache.
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
    ) -> AttentionMetadata:
        if not query_lens or not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError("query_lens, seq_lens and block_tables need one entry per request (at least one)")
        slots: list[int] = []
        starts = [0]
        for r, (qlen, slen, table) in enumerate(zip(query_lens, seq_lens, block_tables)):
            if qlen < 1 or slen < qlen:
                raise ValueError(f"request {r}: query_len {qlen} and seq_len {slen} are inconsistent")
            if len(table) * block_size < slen:
                raise ValueError(f"request {r}: {len(table)} blocks cannot hold {slen} tokens")
            for p in range(slen - qlen, slen):
                slots.append(table[p // block_size] * block_size + p % block_size)
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
        )

    @functools.cached_property
    def decode(self) -> DecodeBatch | None:
        """The step's one-token queries, for the torch path."""
        rows = [r for r in range(len(self._seq_lens)) if self._starts[r + 1] - self._starts[r] == 1]
        return _decode_batch(rows, self._starts, self._seq_lens, self._tables, self.block_size,
                             self.slot_mapping.device)

    @functools.cached_property
    def prefills(self) -> list[PrefillChunk]:
        """The step's multi-token chunks, for the torch path."""
        return [_prefill_chunk(self._starts[r], self._starts[r + 1] - self._starts[r], slen, table,
                               self.block_size, self.slot_mapping.device)
                for r, (slen, table) in enumerate(zip(self._seq_lens, self._tables))
                if self._starts[r + 1] - self._starts[r] > 1]

    def float_mask(self, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        key = (id(mask), dtype)
        cached = self._float_masks.get(key)
        if cached is None:
            cached = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
            self._float_masks[key] = cached
        return cached


def _prefill_chunk(
    start: int, qlen: int, slen: int, table: list[int], block_size: int, device: torch.device | str
) -> PrefillChunk:
    if qlen == slen:
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
    )


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store this step's K/V [T, kv_heads, head_dim] at their slots of a layer's cache."""
    d = k.shape[-1]
    if kernels.attention_kernel_available(k.device, k.dtype, d):
        kernels.write_kv_cache(k, v, slot_mapping, kv_cache)
        return
    block_size = kv_cache.shape[3] // d
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    key_cache(kv_cache, d)[blocks, :, :, offsets, :] = k.reshape(k.shape[0], k.shape[1], d // 2, 2)
    value_cache(kv_cache, d)[blocks, :, offsets // 2, :, offsets % 2] = v


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


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    """q [T, H, d], k/v [T, kvh, d] of this step -> attention output [T, H * d].

    Writes k/v into `kv_cache` first, so that each query also sees its own and earlier tokens
    of this step.
    """
    write_kv(kv_cache, k, v, meta.slot_mapping)
    num_tokens, num_heads, d = q.shape
    if kernels.attention_kernel_available(q.device, q.dtype, d):
        out = kernels.paged_attention(q, kv_cache, meta.block_tables, meta.query_start_loc, meta.query_lens,
                                      meta.seq_lens, d**-0.5)
        return out.view(num_tokens, num_heads * d)

    decode = meta.decode
    if decode is not None and not meta.prefills:
        # Pure decode step: the decode tokens are the whole batch, in order.
        return _decode_attention(q, kv_cache, decode, meta)
    out = q.new_empty(num_tokens, num_heads * d)
    if decode is not None:
        out[decode.tokens] = _decode_attention(q[decode.tokens], kv_cache, decode, meta)
    for chunk in meta.prefills:
        out[chunk.start : chunk.end] = _prefill_attention(q, k, v, kv_cache, chunk, meta)
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
) -> torch.Tensor:
    qc = q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)  # [1, H, L, d]
    if chunk.block_ids is None:
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

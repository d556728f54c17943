"""Paged attention on plain torch ops (CPU first; the same code runs on CUDA).

One step's inputs are a flattened varlen batch: the scheduled tokens of all requests
concatenated. Each layer writes its new K/V into the paged cache and then lets every
request's queries attend over that request's whole context, read through its block table.

On the CPU two C kernels (`tokenweir.model.kernels`) do this straight from the paged cache: one
for all the step's one-token queries (decodes), one for all its multi-token chunks (prefills).
Elsewhere, or without a C compiler, torch does it: decodes in a single SDPA call over a padded
batch, each prefill chunk in its own call. Everything that depends only on the step (gather
indices, masks, the kernels' int32 tables) is computed once in `AttentionMetadata.build`, not
in each of the model's layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tokenweir.model import kernels
from tokenweir.model.kernels import kernels_available, prefill_kernel_available

if TYPE_CHECKING:
    from tokenweir.model.llama import ModelArchConfig


@dataclass
class DecodeBatch:
    """All one-token queries of the step, attended in one padded SDPA call."""

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
    # For the C kernel, which reads the cache through the tables directly: int32 [n, num_blocks]
    # and int32 [n].
    block_tables: torch.Tensor
    seq_lens: torch.Tensor


@dataclass
class PrefillChunk:
    """One request's chunk of several query tokens."""

    start: int
    end: int
    seq_len: int
    # None when the chunk is the request's whole context so far: it then attends to its own
    # fresh K/V with a plain causal mask, without reading the cache.
    block_ids: torch.Tensor | None
    # Causal mask with offset [query_len, seq_len] (True = attend), when block_ids is set.
    mask: torch.Tensor | None


@dataclass
class PrefillBatch:
    """All prefill chunks of the step as int32 tensors, for the C prefill kernel (one call)."""

    chunk_starts: torch.Tensor  # [num_chunks]: first row of each chunk in the flattened batch
    chunk_lens: torch.Tensor  # [num_chunks]
    seq_lens: torch.Tensor  # [num_chunks]
    block_tables: torch.Tensor  # [num_chunks, max_blocks], padded with 0


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [T]: cache slot of each new token's K/V
    query_start_loc: torch.Tensor  # int32 [B+1]
    seq_lens: torch.Tensor  # int32 [B]: context length including this step's tokens
    block_tables: torch.Tensor  # int32 [B, max_blocks_per_seq], padded with 0
    query_lens_list: list[int]
    seq_lens_list: list[int]
    block_size: int
    decode: DecodeBatch | None
    prefills: list[PrefillChunk]
    prefill_batch: PrefillBatch | None
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
        decode_rows: list[int] = []
        prefill_rows: list[int] = []
        prefills: list[PrefillChunk] = []
        for r, (qlen, slen, table) in enumerate(zip(query_lens, seq_lens, block_tables)):
            if qlen < 1 or slen < qlen:
                raise ValueError(f"request {r}: query_len {qlen} and seq_len {slen} are inconsistent")
            if len(table) * block_size < slen:
                raise ValueError(f"request {r}: {len(table)} blocks cannot hold {slen} tokens")
            start = starts[-1]
            for p in range(slen - qlen, slen):
                slots.append(table[p // block_size] * block_size + p % block_size)
            starts.append(start + qlen)
            if qlen == 1:
                decode_rows.append(r)
            else:
                prefill_rows.append(r)
                prefills.append(_prefill_chunk(start, qlen, slen, table, block_size, device))

        max_blocks = max(len(t) for t in block_tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            query_lens_list=list(query_lens),
            seq_lens_list=list(seq_lens),
            block_size=block_size,
            decode=_decode_batch(decode_rows, starts, seq_lens, block_tables, block_size, device),
            prefills=prefills,
            prefill_batch=_prefill_batch(prefill_rows, starts, query_lens, seq_lens, block_tables, device),
        )

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


def _prefill_batch(
    rows: list[int],
    starts: list[int],
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: list[list[int]],
    device: torch.device | str,
) -> PrefillBatch | None:
    if not rows:
        return None
    width = max(len(block_tables[r]) for r in rows)

    def int32(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    return PrefillBatch(
        chunk_starts=int32([starts[r] for r in rows]),
        chunk_lens=int32([query_lens[r] for r in rows]),
        seq_lens=int32([seq_lens[r] for r in rows]),
        block_tables=int32([block_tables[r] + [0] * (width - len(block_tables[r])) for r in rows]),
    )


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
        block_tables=torch.tensor(flat, dtype=torch.int32, device=device).view(len(rows), nblocks),
        seq_lens=lens_tensor,
    )


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store this step's K/V [T, kv_heads, head_dim] at their slots of a layer's cache."""
    _, num_blocks, block_size, kvh, d = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, kvh, d)
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def _gather_context(cache: torch.Tensor, block_ids: torch.Tensor, blocks_per_seq: int, seq_len: int) -> torch.Tensor:
    """K or V of requests through their flattened block tables: [num_seqs, seq_len, kvh, d]."""
    _, block_size, kvh, d = cache.shape
    gathered = torch.index_select(cache, 0, block_ids)
    return gathered.view(-1, blocks_per_seq * block_size, kvh, d)[:, :seq_len]


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    """q [T, H, d], k/v [T, kvh, d] of this step -> attention output [T, H * d].

    Writes k/v into `kv_cache` ([2, num_blocks, block_size, kvh, d]) first, so that each
    query also sees its own and earlier tokens of this step.
    """
    write_kv(kv_cache, k, v, meta.slot_mapping)
    num_tokens, num_heads, d = q.shape
    decode = meta.decode
    if decode is not None and not meta.prefills:
        # Pure decode step: the decode tokens are the whole batch, in order.
        return _decode_attention(q, kv_cache, decode, meta)

    out = q.new_empty(num_tokens, num_heads, d)
    if decode is not None:
        out[decode.tokens] = _decode_attention(q[decode.tokens], kv_cache, decode, meta).view(-1, num_heads, d)
    if meta.prefill_batch is not None and prefill_kernel_available(q.device, q.dtype, d):
        batch = meta.prefill_batch
        kernels.paged_prefill_attention(q, kv_cache[0], kv_cache[1], out, batch.block_tables, batch.chunk_starts,
                                        batch.chunk_lens, batch.seq_lens, d**-0.5)
    else:
        for chunk in meta.prefills:
            out[chunk.start : chunk.end] = _prefill_attention(q, k, v, kv_cache, chunk, meta).view(-1, num_heads, d)
    return out.view(num_tokens, num_heads * d)


def _decode_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, decode: DecodeBatch, meta: AttentionMetadata
) -> torch.Tensor:
    num_seqs, num_heads, d = q.shape
    if kernels_available(q.device, q.dtype):
        out = kernels.paged_decode_attention(q, kv_cache[0], kv_cache[1], decode.block_tables,
                                             decode.seq_lens, d**-0.5)
        return out.view(num_seqs, num_heads * d)
    kvh = kv_cache.shape[3]
    # GQA without repeating K/V: the query heads sharing a KV head become that head's rows
    # (HF maps query head h to KV head h // group, so a plain view groups them right). All
    # rows of one request sit at the same position, so only key padding needs masking.
    qg = q.reshape(num_seqs, kvh, num_heads // kvh, d)
    k = _gather_context(kv_cache[0], decode.block_ids, decode.num_blocks, decode.max_seq_len)
    v = _gather_context(kv_cache[1], decode.block_ids, decode.num_blocks, decode.max_seq_len)
    mask = meta.float_mask(decode.key_mask, q.dtype)
    out = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
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
        nblocks = chunk.block_ids.shape[0]
        kc = _gather_context(kv_cache[0], chunk.block_ids, nblocks, chunk.seq_len).transpose(1, 2)
        vc = _gather_context(kv_cache[1], chunk.block_ids, nblocks, chunk.seq_len).transpose(1, 2)
        mask = meta.float_mask(chunk.mask, q.dtype)
        out = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1).reshape(chunk.end - chunk.start, -1)


def kv_cache_bytes_per_block(arch: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (K and V): divide a memory budget by this."""
    elem = torch.empty((), dtype=dtype).element_size()
    return arch.num_hidden_layers * 2 * block_size * arch.num_key_value_heads * arch.head_dim * elem


def allocate_kv_caches(
    arch: ModelArchConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
) -> list[torch.Tensor]:
    """One [2, num_blocks, block_size, kv_heads, head_dim] tensor per layer (K at 0, V at 1)."""
    shape = (2, num_blocks, block_size, arch.num_key_value_heads, arch.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(arch.num_hidden_layers)]

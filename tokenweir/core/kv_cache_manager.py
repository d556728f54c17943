"""Per-request block tables on top of the block pool: prefix lookup, allocation, free.

Block hashes are chained: hash(parent hash, the block's token ids), with extra keys (the cache
salt) folded into the first parent, so a block is only ever shared by requests whose whole
prefix up to and including it is identical.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from tokenweir.core.block_pool import BlockHash, BlockPool, KVBlock
from tokenweir.request import Request

_NO_PARENT = 0


@dataclass
class PrefixCacheStats:
    """Cumulative prefix-cache counters, in tokens. Lookups made when a preempted request is
    re-admitted are counted apart: they mostly find the request's own blocks again and would
    otherwise inflate the hit rate users read as "how much do prompts share"."""

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    resets: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def hash_block_tokens(parent: int, token_ids: Sequence[int]) -> BlockHash:
    # Python's hash of a tuple of ints is deterministic across processes and 64 bits wide:
    # collisions among a pool's worth of blocks are vanishingly rare.
    return BlockHash(hash((parent, tuple(token_ids))))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 watermark_blocks: int = 0) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.watermark_blocks = watermark_blocks
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request are already published in the hash map.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    def get_num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def get_usage(self) -> float:
        return self.block_pool.get_usage()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def _update_block_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend `request.block_hashes` to cover the full blocks among its first num_tokens."""
        hashes = request.block_hashes
        num_full = num_tokens // self.block_size
        if len(hashes) >= num_full:
            return
        bs = self.block_size
        if hashes:
            parent = hashes[-1]
        else:
            parent = hash(("cache_salt", request.cache_salt)) if request.cache_salt else _NO_PARENT
        tokens = request.all_token_ids
        for i in range(len(hashes), num_full):
            parent = hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs])
            hashes.append(parent)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of the request's tokens: (blocks, number of tokens).

        Pure read: nothing is touched or counted until `allocate_slots` admits the request.
        """
        if not self.enable_caching:
            return [], 0
        # Never hit the last token: its forward pass is what produces the logits for the next
        # token, so at least one token must always be computed.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        self._update_block_hashes(request, max_hit_blocks * self.block_size)
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (),
        num_new_computed_tokens: int = 0,
        apply_watermark: bool = False,
    ) -> Optional[list[KVBlock]]:
        """Make room for `num_new_tokens` more tokens of `request`; all or nothing.

        Block table after the call::

            | blocks it owns | new_computed_blocks (hits) | new blocks        |
            |<-- num_computed_tokens + num_new_computed -->|<- num_new_tokens ->|

        Returns the newly taken blocks (possibly empty), or None, leaving everything unchanged,
        if the pool cannot supply them. Hits with ref count 0 sit in the free queue, so taking
        them consumes free capacity too. With `apply_watermark` (admitting a waiting request),
        `watermark_blocks` must stay free afterwards; running requests may dip below it.
        """
        req_blocks = self.req_to_blocks.get(request.request_id)
        num_owned = len(req_blocks) if req_blocks is not None else 0
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_total = num_computed + num_new_tokens
        num_required = -(-num_total // self.block_size)
        num_new_blocks = max(0, num_required - num_owned - len(new_computed_blocks))
        num_free_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        reserve = self.watermark_blocks if apply_watermark else 0
        if num_new_blocks + num_free_hits + reserve > self.block_pool.get_num_free_blocks():
            return None

        if req_blocks is None:
            req_blocks = self.req_to_blocks[request.request_id] = []
            self.num_cached_blocks[request.request_id] = 0
        if new_computed_blocks:
            # Touch the hits before taking new blocks so that eviction cannot pick them.
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            self.num_cached_blocks[request.request_id] = len(req_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request) -> None:
        """Publish the request's blocks that are full of computed tokens.

        Called after a step ran, never at allocation: a request preempted later in the same
        step would otherwise leave published blocks whose K/V nobody ever wrote.
        """
        if not self.enable_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        start = self.num_cached_blocks.get(request.request_id, num_full)
        if num_full <= start:
            return
        self._update_block_hashes(request, request.num_computed_tokens)
        req_blocks, hashes = self.req_to_blocks[request.request_id], request.block_hashes
        for i in range(start, num_full):
            self.block_pool.cache_full_block(req_blocks[i], hashes[i])
        self.num_cached_blocks[request.request_id] = num_full

    def record_prefix_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count an admission's lookup (called once the admission succeeded)."""
        if not self.enable_caching:
            return
        stats = self.prefix_cache_stats
        if request.num_preemptions:
            stats.preempted_requests += 1
            stats.preempted_queries += request.num_tokens
            stats.preempted_hits += num_hit_tokens
        else:
            stats.requests += 1
            stats.queries += request.num_tokens
            stats.hits += num_hit_tokens

    def free(self, request: Request) -> None:
        """Return the request's blocks, tail first: the tail is the least likely to be shared,
        so it should be the first to be evicted."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> None:
        self.block_pool.reset_prefix_cache()
        self.prefix_cache_stats.resets += 1

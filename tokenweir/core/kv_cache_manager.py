"""Per-request block tables on top of the block pool: prefix lookup, allocation, free, and the
host tier that swap preemption copies blocks to.

Block keys are chained (core/block_hash.py): key(parent key, the block's token ids), with extra
keys (the cache salt, the KV dtype) folded into the first parent, so a block is only ever shared
by requests whose whole prefix up to and including it is identical and stored alike.

Int8 K/V (low-priority requests, `int8_min_priority`): such a request's blocks are the same
device blocks, their bytes holding `int8_block_size` int8 tokens with their scales instead of
`block_size` tokens of the model's dtype (model/attention.py). So memory is counted in blocks of
one size in bytes, and an int8 request simply needs fewer of them for the same tokens. Its
block keys start from another root, so an int8 block is never shared with a request that reads
the model's dtype, and the other way round.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Optional, Sequence

from tokenweir.core.block_hash import BlockHash, BlockHasher
from tokenweir.core.block_pool import BlockPool, KVBlock
from tokenweir.request import Request


def extend_block_hashes(hasher: BlockHasher, hashes: list[BlockHash], tokens: Sequence[int], block_size: int,
                        num_full: int, cache_salt: Optional[str], kv_int8: bool) -> None:
    """Extend `hashes`, the keys of the first full blocks of `tokens`, to `num_full` blocks. The
    one definition of a request's block keys: a cluster's router computes a prompt's with it to
    ask which replica caches them."""
    if len(hashes) >= num_full:
        return
    if hashes:
        parent = hashes[-1]
    else:
        extra = (("cache_salt", cache_salt),) if cache_salt else ()
        if kv_int8:
            extra += (("kv_dtype", "int8"),)
        parent = hasher.root(extra)
    for i in range(len(hashes), num_full):
        parent = hasher.hash_block(parent, tokens[i * block_size:(i + 1) * block_size])
        hashes.append(parent)


@dataclass(frozen=True, slots=True)
class KVCacheBlocks:
    """Blocks as the manager hands them to the scheduler: the scheduler passes them on and
    reads their ids, never their internals. Today one device tier; a host tier (swap) or a
    compressed group joins here without changing the scheduler loop."""

    blocks: tuple[KVBlock, ...] = ()

    def get_block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    def __bool__(self) -> bool:
        return bool(self.blocks)


EMPTY_BLOCKS = KVCacheBlocks()


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


SwapPairs = list[tuple[int, int]]  # (device block id, host block id)

INT8_SCALE_BYTES = 4  # one float32 scale per group of channels of a token and KV head, K and V apart
# Channels per scale: K's error dominates, and a scale per 32 channels instead of one per head
# cuts it by about 40% for 7% fewer tokens per block (docs/benchmarks/kv_int8_schemes.md).
INT8_SCALE_GROUP = 32


def int8_scale_group(head_dim: int) -> int:
    """Channels that share a scale: 32, or the whole head where 32 does not divide it."""
    return INT8_SCALE_GROUP if head_dim % INT8_SCALE_GROUP == 0 else head_dim


def int8_tokens_per_block(block_size: int, head_dim: int, element_size: int) -> int:
    """Tokens an int8 block holds: as many (even, for the pair layout) as fit, with their
    scales, in the bytes a block of `block_size` tokens of `element_size`-byte K/V takes."""
    per_token = head_dim + INT8_SCALE_BYTES * (head_dim // int8_scale_group(head_dim))
    num = block_size * head_dim * element_size // per_token // 2 * 2
    if num < 2:
        raise ValueError(f"a block of {block_size} tokens x {head_dim} x {element_size} bytes holds fewer than 2 "
                         "int8 tokens with their scales; use a larger block_size")
    return num


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 watermark_blocks: int = 0, hasher: Optional[BlockHasher] = None,
                 num_host_blocks: int = 0, int8_block_size: int = 0,
                 int8_min_priority: Optional[int] = None) -> None:
        if int8_min_priority is not None and int8_block_size < 2:
            raise ValueError(f"int8 K/V for priority >= {int8_min_priority} needs the tokens an int8 block holds "
                             f"(int8_block_size >= 2), got {int8_block_size}")
        self.block_size = block_size
        self.int8_block_size = int8_block_size
        self.int8_min_priority = int8_min_priority
        self.enable_caching = enable_caching
        self.watermark_blocks = watermark_blocks
        self.hasher = hasher or BlockHasher()
        self.block_pool = BlockPool(num_blocks)
        # The host tier (swap space): a pool of its own, never hashed, never shared.
        self.host_pool: Optional[BlockPool] = BlockPool(num_host_blocks) if num_host_blocks else None
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self.req_to_host_blocks: dict[str, list[KVBlock]] = {}  # swapped-out requests' K/V
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

    def assign_kv_dtype(self, request: Request) -> None:
        """Decide, once when the request is added, whether its K/V are stored in int8."""
        request.kv_int8 = self.int8_min_priority is not None and request.priority >= self.int8_min_priority

    def tokens_per_block(self, request: Request) -> int:
        return self.int8_block_size if request.kv_int8 else self.block_size

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def _update_block_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend `request.block_hashes` to cover the full blocks among its first num_tokens."""
        bs = self.tokens_per_block(request)
        extend_block_hashes(self.hasher, request.block_hashes, request.all_token_ids, bs, num_tokens // bs,
                            request.cache_salt, request.kv_int8)

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of the request's tokens: (blocks, number of tokens).

        Pure read: nothing is touched or counted until `allocate_slots` admits the request.
        """
        if not self.enable_caching:
            return EMPTY_BLOCKS, 0
        # Never hit the last token: its forward pass is what produces the logits for the next
        # token, so at least one token must always be computed.
        bs = self.tokens_per_block(request)
        max_hit_blocks = (request.num_tokens - 1) // bs
        self._update_block_hashes(request, max_hit_blocks * bs)
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return KVCacheBlocks(tuple(hits)), len(hits) * bs

    def _num_new_blocks(self, request: Request, num_new_tokens: int, new_computed: KVCacheBlocks,
                        num_new_computed_tokens: int) -> int:
        req_blocks = self.req_to_blocks.get(request.request_id)
        num_owned = len(req_blocks) if req_blocks is not None else 0
        num_total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_required = -(-num_total // self.tokens_per_block(request))
        return max(0, num_required - num_owned - new_computed.num_blocks)

    def can_allocate(self, request: Request, num_new_tokens: int, new_computed: KVCacheBlocks = EMPTY_BLOCKS,
                     num_new_computed_tokens: int = 0, *, apply_watermark: bool = False,
                     freeing: Sequence[Request] = ()) -> bool:
        """Whether `allocate_slots` would succeed, once the requests in `freeing` are freed.

        Exact, not an estimate: a block of theirs only returns to the pool if no other request
        still holds it, and a hit only they held turns into a free hit, which the allocation
        then takes from the pool too.
        """
        num_new = self._num_new_blocks(request, num_new_tokens, new_computed, num_new_computed_tokens)
        if not freeing:
            return self._fits(num_new, new_computed, apply_watermark)
        released: Counter[int] = Counter()
        blocks_by_id: dict[int, KVBlock] = {}
        for other in freeing:
            for block in self.req_to_blocks.get(other.request_id, ()):
                released[block.block_id] += 1
                blocks_by_id[block.block_id] = block
        num_freed = sum(1 for bid, n in released.items() if blocks_by_id[bid].ref_cnt == n)
        num_free_hits = sum(1 for b in new_computed.blocks if b.ref_cnt == released[b.block_id])
        reserve = self.watermark_blocks if apply_watermark else 0
        return num_new + num_free_hits + reserve <= self.block_pool.get_num_free_blocks() + num_freed

    def _fits(self, num_new_blocks: int, new_computed: KVCacheBlocks, apply_watermark: bool) -> bool:
        # Hits with ref count 0 sit in the free queue: taking them consumes free capacity too.
        num_free_hits = sum(1 for b in new_computed.blocks if b.ref_cnt == 0)
        reserve = self.watermark_blocks if apply_watermark else 0
        return num_new_blocks + num_free_hits + reserve <= self.block_pool.get_num_free_blocks()

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed: KVCacheBlocks = EMPTY_BLOCKS,
        num_new_computed_tokens: int = 0,
        apply_watermark: bool = False,
    ) -> Optional[KVCacheBlocks]:
        """Make room for `num_new_tokens` more tokens of `request`; all or nothing.

        Block table after the call::

            | blocks it owns | new_computed (hits) | new blocks        |
            |<-- num_computed_tokens + num_new_computed -->|<- num_new_tokens ->|

        Returns the newly taken blocks (possibly none), or None, leaving everything unchanged,
        if the pool cannot supply them. With `apply_watermark` (admitting a waiting request),
        `watermark_blocks` must stay free afterwards; running requests may dip below it.
        """
        req_blocks = self.req_to_blocks.get(request.request_id)
        if (req_blocks is not None and not new_computed.blocks
                and request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
                <= len(req_blocks) * (self.int8_block_size if request.kv_int8 else self.block_size)):
            # Most decode steps: the last block has room. Checked inline, before anything else
            # is looked up, as it runs for every running request of every step.
            return EMPTY_BLOCKS
        num_new_blocks = self._num_new_blocks(request, num_new_tokens, new_computed, num_new_computed_tokens)
        if not self._fits(num_new_blocks, new_computed, apply_watermark):
            return None
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request.request_id] = []
            self.num_cached_blocks[request.request_id] = 0
        if new_computed:
            # Touch the hits before taking new blocks so that eviction cannot pick them.
            self.block_pool.touch(new_computed.blocks)
            req_blocks.extend(new_computed.blocks)
            self.num_cached_blocks[request.request_id] = len(req_blocks)
        if not num_new_blocks:
            return EMPTY_BLOCKS
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        req_blocks.extend(new_blocks)
        return KVCacheBlocks(tuple(new_blocks))

    def cache_blocks(self, request: Request) -> None:
        """Publish the request's blocks that are full of computed tokens.

        Called after a step ran, never at allocation: a request preempted later in the same
        step would otherwise leave published blocks whose K/V nobody ever wrote.
        """
        if not self.enable_caching:
            return
        num_full = request.num_computed_tokens // self.tokens_per_block(request)
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
        """Return the request's blocks of both tiers, device blocks tail first: the tail is the
        least likely to be shared, so it should be the first to be evicted."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))
        host_blocks = self.req_to_host_blocks.pop(request.request_id, None)
        if host_blocks:
            assert self.host_pool is not None
            self.host_pool.free_blocks(host_blocks)

    # ------------------------------------------------------------------ swap (host tier)
    #
    # Swap-out copies every block that holds computed K/V to the host, shared ones (ref > 1)
    # included, and then drops the request's device references exactly as `free` does. So a
    # swap victim frees the same device blocks as a recompute victim (`can_allocate(freeing=)`
    # plans both alike), and a swapped request never depends on a device block it does not
    # hold. Swap-in reuses a block that is still in the prefix cache (its own published blocks,
    # or a prefix other requests hold) instead of copying it back.

    def get_num_swap_blocks(self, request: Request) -> int:
        """Blocks a swap-out of `request` copies: those holding its computed tokens."""
        return -(-request.num_computed_tokens // self.tokens_per_block(request))

    def get_num_shared_blocks(self, request: Request) -> int:
        """Blocks of `request` that another request also holds: they stay in the device cache
        when it leaves, so a return (by swap or recompute) is expected to find them."""
        return sum(1 for b in self.req_to_blocks.get(request.request_id, ()) if b.ref_cnt > 1)

    def get_num_free_host_blocks(self) -> int:
        return self.host_pool.get_num_free_blocks() if self.host_pool else 0

    def get_host_usage(self) -> Optional[float]:
        return self.host_pool.get_usage() if self.host_pool else None

    def can_swap_out(self, request: Request) -> bool:
        num = self.get_num_swap_blocks(request)
        return 0 < num <= self.get_num_free_host_blocks()

    def swap_out(self, request: Request) -> SwapPairs:
        """Move the request's computed K/V to host blocks and free its device blocks at once;
        returns the copies the runner must make before this step's forward pass writes into
        the freed blocks. Call only when `can_swap_out`."""
        assert self.host_pool is not None and request.request_id not in self.req_to_host_blocks
        num = self.get_num_swap_blocks(request)
        device_blocks = self.req_to_blocks[request.request_id][:num]
        host_blocks = self.host_pool.get_new_blocks(num)
        self.free(request)  # its device blocks only: it holds no host blocks yet
        self.req_to_host_blocks[request.request_id] = host_blocks
        return [(d.block_id, h.block_id) for d, h in zip(device_blocks, host_blocks)]

    def swap_in(self, request: Request, num_new_tokens: int,
                apply_watermark: bool = False) -> Optional[SwapPairs]:
        """Device blocks for a swapped-out request's computed tokens plus `num_new_tokens` more,
        all or nothing (None, nothing changed, if they do not fit). Returns the copies the
        runner must make before attention reads them; the host blocks are freed at once."""
        rid = request.request_id
        host_blocks = self.req_to_host_blocks[rid]
        bs = self.tokens_per_block(request)
        num_required = -(-(request.num_computed_tokens + num_new_tokens) // bs)
        hits: dict[int, KVBlock] = {}
        if self.enable_caching:
            # Only blocks it had computed whole: a partly computed last one (swapped out
            # mid-chunk) is written on, so it must be its own copy, never a shared cached block.
            num_full = min(len(host_blocks), request.num_computed_tokens // bs)
            for i, block_hash in enumerate(request.block_hashes[:num_full]):
                block = self.block_pool.get_cached_block(block_hash)
                if block is not None:
                    hits[i] = block
        num_new = num_required - len(hits)
        if not self._fits(num_new, KVCacheBlocks(tuple(hits.values())), apply_watermark):
            return None
        self.block_pool.touch(hits.values())  # before taking new blocks, so none is evicted
        new_blocks = iter(self.block_pool.get_new_blocks(num_new))
        blocks = [hits[i] if i in hits else next(new_blocks) for i in range(num_required)]
        self.req_to_blocks[rid] = blocks
        # Copied-in blocks carry no hash: publishing from the first block again (cache_blocks)
        # restores their prefix-cache entries where no other copy took them meanwhile.
        self.num_cached_blocks[rid] = 0
        pairs = [(blocks[i].block_id, h.block_id) for i, h in enumerate(host_blocks) if i not in hits]
        assert self.host_pool is not None
        self.host_pool.free_blocks(self.req_to_host_blocks.pop(rid))
        return pairs

    def reset_prefix_cache(self) -> None:
        self.block_pool.reset_prefix_cache()
        self.prefix_cache_stats.resets += 1

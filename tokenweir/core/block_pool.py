"""The pool of KV blocks: ref counts, the LRU free queue and the hash -> cached block map.

A block with ref count 0 is free, but if it holds a full block's hash it still serves prefix
cache hits until it is reused. Reuse takes blocks from the head of the free queue (least
recently freed first) and only then drops the hash ("lazy eviction").
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Optional

from tokenweir.core.block_hash import BlockHash


class KVBlock:
    """One block of `block_size` token slots in the KV cache."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[BlockHash] = None  # set once the block is full and cached
        # Links of the free queue; None while the block is in use.
        self.prev_free: Optional[KVBlock] = None
        self.next_free: Optional[KVBlock] = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """Doubly linked list of free blocks, least recently freed at the head.

    A plain deque cannot remove a block from the middle in O(1), which is what a prefix-cache
    hit on a free block needs; sentinels keep the link updates branch-free.
    """

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free block left")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"{block} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVBlock]:
        block = self._head.next_free
        while block is not self._tail and block is not None:
            yield block
            block = block.next_free


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got num_blocks={num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVBlock] = {}

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> Optional[KVBlock]:
        return self.cached_block_hash_to_block.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take blocks from the head of the free queue, evicting their cached hashes."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"cannot take {num_blocks} blocks: only "
                             f"{self.free_block_queue.num_free_blocks} are free")
        new_blocks = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            if block.block_hash is not None:
                del self.cached_block_hash_to_block[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            new_blocks.append(block)
        return new_blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Share prefix-cache hits: a free hit leaves the free queue before its count rises."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_block(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Publish a newly filled block under its hash.

        If another block already holds the same content (two requests computed the same prefix
        in the same step), the first one stays the cached copy and this one remains private.
        """
        if block.block_hash is None and block_hash not in self.cached_block_hash_to_block:
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; blocks reaching 0 join the tail of the free queue.

        Callers pass a request's blocks tail first, so its unshared tail is evicted before the
        shared prefix it hangs from.
        """
        for block in ordered_blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"{block} freed more often than allocated"
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash, in use or not. Blocks in use stay with their requests; their
        managers have already counted them as cached, so they are never re-published."""
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()

"""The host tier of the KV cache (swap space) and the block copies between it and the device.

Host blocks have the device blocks' layout: per layer one `[2, num_host_blocks, kv_heads,
block_size * head_dim]` tensor in host memory, pinned when the device is CUDA (so the copies
are DMA transfers). On the CPU it is a pool of its own beside the device cache, so a swap is a
real copy with its own memory budget, as on a GPU.

Copies are `index_select` from the source and `index_copy_` into the destination: indexing a
tensor with an index tensor returns a new tensor, so `cache[:, ids].copy_(x)` or
`cache[:, ids][...] = x` would write into that copy and leave the cache as it was.
"""

from __future__ import annotations

import time

import torch

from tokenweir.core.kv_cache_manager import SwapPairs


class HostKVCache:
    def __init__(self, device_caches: list[torch.Tensor], num_blocks: int) -> None:
        self.device = device_caches[0].device
        pin = self.device.type == "cuda"
        self.caches = [torch.zeros((c.shape[0], num_blocks, *c.shape[2:]), dtype=c.dtype, device="cpu",
                                   pin_memory=pin) for c in device_caches]
        self.num_blocks = num_blocks

    def _indices(self, pairs: SwapPairs) -> tuple[torch.Tensor, torch.Tensor]:
        device_ids, host_ids = zip(*pairs)
        return (torch.tensor(device_ids, dtype=torch.long, device=self.device),
                torch.tensor(host_ids, dtype=torch.long))

    def swap_out(self, device_caches: list[torch.Tensor], pairs: SwapPairs) -> None:
        """Copy device blocks to host blocks, (device id, host id) per pair."""
        if not pairs:
            return
        device_ids, host_ids = self._indices(pairs)
        for device_cache, host_cache in zip(device_caches, self.caches):
            host_cache.index_copy_(1, host_ids, device_cache.index_select(1, device_ids).cpu())

    def swap_in(self, device_caches: list[torch.Tensor], pairs: SwapPairs) -> None:
        """Copy host blocks back into device blocks, (device id, host id) per pair."""
        if not pairs:
            return
        device_ids, host_ids = self._indices(pairs)
        for device_cache, host_cache in zip(device_caches, self.caches):
            device_cache.index_copy_(1, device_ids, host_cache.index_select(1, host_ids).to(self.device))

    def measure_bandwidth(self, device_caches: list[torch.Tensor], num_blocks: int = 32,
                          repeats: int = 3) -> float:
        """Bytes per second of a swap out and back in of `num_blocks` blocks on these very
        tensors (the best of `repeats`, after a warm-up). Run before any request holds blocks:
        it overwrites the first blocks of both tiers."""
        num_blocks = min(num_blocks, self.num_blocks, device_caches[0].shape[1])
        pairs = [(i, i) for i in range(num_blocks)]
        block_bytes = sum(c[:, 0].numel() * c.element_size() for c in device_caches)
        best = float("inf")
        for i in range(repeats + 1):
            start = time.perf_counter()
            self.swap_out(device_caches, pairs)
            self.swap_in(device_caches, pairs)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            if i:
                best = min(best, time.perf_counter() - start)
        return 2 * num_blocks * block_bytes / best

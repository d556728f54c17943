"""The host tier's copies: a round trip device -> host -> other device blocks lands in the
caches themselves (an index tensor makes a copy, so a write through one would be lost), on the
CPU and, where present, CUDA."""

from __future__ import annotations

import pytest
import torch

from tokenweir.model.swap import HostKVCache

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def device_caches(device: str, num_blocks: int = 8, num_layers: int = 3) -> list[torch.Tensor]:
    # [2, num_blocks, kv_heads, block_size * head_dim], as model/attention.py allocates them.
    return [torch.zeros((2, num_blocks, 2, 4 * 8), device=device) for _ in range(num_layers)]


@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_lands_in_the_caches(device):
    caches = device_caches(device)
    for layer, cache in enumerate(caches):
        cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(layer)).to(device))
    original = [c.clone() for c in caches]
    host = HostKVCache(caches, num_blocks=4)
    assert all(h.device.type == "cpu" for h in host.caches)
    assert all(h.is_pinned() == (device == "cuda") for h in host.caches)

    host.swap_out(caches, [(5, 0), (2, 3)])  # device 5 -> host 0, device 2 -> host 3
    for layer, h in enumerate(host.caches):
        assert torch.equal(h[:, 0], original[layer][:, 5].cpu())
        assert torch.equal(h[:, 3], original[layer][:, 2].cpu())
        assert not h[:, 1:3].any()  # untouched host blocks stay as they were
    for c in caches:
        c.zero_()  # the freed device blocks are overwritten by other requests

    host.swap_in(caches, [(7, 0), (1, 3)])  # back into other device blocks
    for layer, c in enumerate(caches):
        assert torch.equal(c[:, 7], original[layer][:, 5])
        assert torch.equal(c[:, 1], original[layer][:, 2])
        others = [b for b in range(c.shape[1]) if b not in (1, 7)]
        assert not c[:, others].any()


def test_empty_pairs_copy_nothing():
    caches = device_caches("cpu")
    host = HostKVCache(caches, num_blocks=2)
    host.swap_out(caches, [])
    host.swap_in(caches, [])
    assert not any(h.any() for h in host.caches)


def test_measured_bandwidth_is_positive_and_leaves_no_data_behind():
    caches = device_caches("cpu")
    host = HostKVCache(caches, num_blocks=4)
    assert host.measure_bandwidth(caches) > 0
    assert not any(c.any() for c in caches)  # it copied the empty cache's own zeros

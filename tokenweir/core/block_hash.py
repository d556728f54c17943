"""Keys of full KV blocks for the prefix cache.

A block's key is a cryptographic hash (BLAKE2b, 32 bytes) of a canonical byte encoding of its
parent's key and its token ids; the first block's parent is a root key made from the request's
extra keys (its cache salt). A hit compares keys only, so keys must be infeasible to forge: with
a 64-bit non-cryptographic hash one crafted prompt could claim the blocks of another prompt and
change every later answer that shares them. An optional secret key (shared by the replicas of one
deployment, so a router computes the same keys) also makes them unpredictable from outside.

The encoding is fixed-width little-endian, independent of the process, the machine and
PYTHONHASHSEED: the same tokens give the same key in every process of a deployment.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import NewType, Optional

BlockHash = NewType("BlockHash", bytes)

DIGEST_SIZE = 32
_ROOT_DOMAIN = b"tokenweir.kv-block-root.v1"
_MAX_KEY_BYTES = 64  # BLAKE2b's key limit


def _encode_str(value: str) -> bytes:
    data = value.encode("utf-8")
    return len(data).to_bytes(4, "little") + data


class BlockHasher:
    def __init__(self, key: Optional[bytes] = None) -> None:
        if key is not None and not 0 < len(key) <= _MAX_KEY_BYTES:
            raise ValueError(f"the prefix-cache hash key must be 1 to {_MAX_KEY_BYTES} bytes, got {len(key)}")
        # Keying BLAKE2b costs a compression of its own: do it once and copy the state.
        self._keyed = hashlib.blake2b(digest_size=DIGEST_SIZE, key=key or b"")
        self._packers: dict[int, struct.Struct] = {}  # little-endian int64s, one per block length
        self._roots: dict[tuple[tuple[str, str], ...], BlockHash] = {}

    def root(self, extra_keys: tuple[tuple[str, str], ...] = ()) -> BlockHash:
        """The parent key of a request's first block: requests whose extra keys differ (another
        cache salt, later another KV dtype) never share a block."""
        root = self._roots.get(extra_keys)
        if root is None:
            data = _ROOT_DOMAIN + b"".join(_encode_str(k) + _encode_str(v) for k, v in extra_keys)
            root = self._roots[extra_keys] = self._digest(data)
            if len(self._roots) > 4096:  # salts are per tenant; never let them pile up
                self._roots.clear()
        return root

    def hash_block(self, parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
        packer = self._packers.get(len(token_ids))
        if packer is None:
            packer = self._packers[len(token_ids)] = struct.Struct(f"<{len(token_ids)}q")
        state = self._keyed.copy()
        state.update(parent)
        state.update(packer.pack(*token_ids))
        return BlockHash(state.digest())

    def _digest(self, data: bytes) -> BlockHash:
        state = self._keyed.copy()
        state.update(data)
        return BlockHash(state.digest())

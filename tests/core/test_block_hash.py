"""Prefix-cache keys: cryptographic, canonical, stable across processes, salted per tenant."""

import os
import subprocess
import sys

import pytest

from tests.core.helpers import PagedFakeRunner, create_scheduler, make_request, reference_stream, run_until_done, step
from tokenweir.core.block_hash import BlockHash, BlockHasher
from tokenweir.core.kv_cache_manager import KVCacheManager


class _WeakHasher(BlockHasher):
    """The old shape: a short non-cryptographic key that a client can collide on purpose
    (here: the sum of the tokens, so forging a colliding block is trivial)."""

    def hash_block(self, parent: BlockHash, token_ids) -> BlockHash:
        return BlockHash(hash((parent, sum(token_ids))).to_bytes(8, "little", signed=True))


VICTIM = [10, 20, 30, 40, 50]  # a "system prompt": one full block of 4 and one more token
FORGED = [40, 30, 20, 10, 99]  # another first block with the same weak key


def _serve_forged_then_victim(hasher: BlockHasher):
    s = create_scheduler(num_blocks=16)
    s.kv_cache_manager.hasher = hasher
    runner = PagedFakeRunner(s.block_size, token_fn=lambda context: 3 + sum(context) % 97)
    attacker = make_request("attacker", FORGED, max_tokens=1)
    s.add_request(attacker)
    run_until_done(s, runner)
    victim = make_request("victim", VICTIM, max_tokens=1)
    _, num_hit = s.kv_cache_manager.get_computed_blocks(victim)
    return s, runner, victim, num_hit


def test_a_forged_block_poisons_the_cache_under_a_weak_key_and_not_under_blake2b():
    s, runner, victim, num_hit = _serve_forged_then_victim(_WeakHasher())
    assert num_hit == 4  # the victim would read the attacker's K/V as its own
    s.reset_prefix_cache()

    s, runner, victim, num_hit = _serve_forged_then_victim(BlockHasher())
    assert num_hit == 0
    s.add_request(victim)
    run_until_done(s, runner)
    assert victim.output_token_ids == reference_stream(VICTIM, 1, lambda context: 3 + sum(context) % 97)


def test_keys_are_canonical_and_chained():
    h = BlockHasher()
    root = h.root()
    assert len(root) == 32 and h.hash_block(root, [1, 2, 3, 4]) == h.hash_block(root, (1, 2, 3, 4))
    assert h.hash_block(root, [1, 2, 3, 4]) != h.hash_block(root, [4, 3, 2, 1])
    assert h.hash_block(h.hash_block(root, [1, 2]), [3, 4]) != h.hash_block(h.hash_block(root, [1]), [2, 3, 4])
    # Extra keys are length-prefixed: ("a", "bc") and ("ab", "c") are different tenants.
    assert h.root((("a", "bc"),)) != h.root((("ab", "c"),))
    assert h.root((("cache_salt", "x"),)) != root
    # A deployment key changes every key; two replicas sharing it agree.
    assert BlockHasher(b"k" * 32).root() != root
    assert BlockHasher(b"k" * 32).hash_block(root, [5]) == BlockHasher(b"k" * 32).hash_block(root, [5])


def test_keys_are_the_same_in_another_process_whatever_its_hash_seed():
    code = ("from tokenweir.core.block_hash import BlockHasher; h = BlockHasher(b'deployment-key');"
            "print(h.hash_block(h.root((('cache_salt', 'acme'),)), list(range(16))).hex())")
    h = BlockHasher(b"deployment-key")
    expected = h.hash_block(h.root((("cache_salt", "acme"),)), list(range(16))).hex()
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        got = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert got.stdout.strip() == expected


def test_cache_salt_isolates_tenants_in_the_scheduler(make_scheduler):
    s = make_scheduler()
    runner = PagedFakeRunner(s.block_size)
    prompt = list(range(200, 213))
    a = make_request("a", prompt, max_tokens=2, cache_salt="tenant-a")
    s.add_request(a)
    step(s, runner)
    same = make_request("same", prompt, max_tokens=2, cache_salt="tenant-a")
    other = make_request("other", prompt, max_tokens=2, cache_salt="tenant-b")
    unsalted = make_request("unsalted", prompt, max_tokens=2)
    kv = s.kv_cache_manager
    assert [kv.get_computed_blocks(r)[1] for r in (same, other, unsalted)] == [12, 0, 0]
    run_until_done(s, runner)


def test_a_bad_deployment_key_is_refused():

    with pytest.raises(ValueError, match="the prefix-cache hash key must be 1 to 64 bytes, got 65"):
        BlockHasher(b"x" * 65)
    KVCacheManager(num_blocks=2, block_size=4, hasher=BlockHasher(b"x" * 64))


def test_the_deployment_key_comes_from_the_environment(monkeypatch):
    from tokenweir.config import PREFIX_CACHE_KEY_ENV, EngineArgs
    from tokenweir.core.scheduler import Scheduler

    monkeypatch.setenv(PREFIX_CACHE_KEY_ENV, "ab" * 32)
    cache, sched = EngineArgs().create_engine_configs(model_max_len=256, num_blocks=16)
    assert cache.prefix_cache_hash_key == b"\xab" * 32
    keyed = Scheduler(sched, cache).kv_cache_manager.hasher
    assert keyed.root() == BlockHasher(b"\xab" * 32).root() != BlockHasher().root()
    monkeypatch.setenv(PREFIX_CACHE_KEY_ENV, "not hex")
    with pytest.raises(ValueError, match=f"{PREFIX_CACHE_KEY_ENV} must be hex"):
        EngineArgs()  # refused before any model loads
    monkeypatch.setenv(PREFIX_CACHE_KEY_ENV, "ab" * 65)
    with pytest.raises(ValueError, match="the prefix-cache hash key must be 1 to 64 bytes, got 65"):
        EngineArgs()

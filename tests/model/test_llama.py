"""Our decoder vs transformers (eager, fp32) on the same tiny random weights.

Covers whole prompts in one flattened batch, chunked prefill across steps through a scrambled
paged cache, prefix-cache hits (a request starting mid-prompt on another's blocks) and decode
steps mixed with prefill chunks.
"""

from __future__ import annotations

import random

import pytest
import torch

from tokenweir.model.arch import kv_cache_bytes_per_block
from tokenweir.model.attention import AttentionMetadata, allocate_kv_caches
from tokenweir.model.loader import load_model

BLOCK_SIZE = 4
NUM_BLOCKS = 96
ATOL = 1e-4


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    cache: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in cache:
            folder = tiny_model_dir(arch)
            ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
            cache[arch] = (ref.eval(), load_model(folder, dtype="float32", device="cpu"))
        return cache[arch]

    return get


def hf_logits(ref, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0]


def hf_greedy_sequence(ref, prompt: list[int], new_tokens: int) -> list[int]:
    seq = list(prompt)
    for _ in range(new_tokens):
        seq.append(int(hf_logits(ref, seq)[-1].argmax()))
    return seq


class PagedRunner:
    """A minimal stand-in for the model runner: block tables from a scrambled pool."""

    def __init__(self, loaded, seed: int = 0) -> None:
        self.model = loaded.model
        self.kv = allocate_kv_caches(loaded.arch, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")
        self.free = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}

    def ensure_blocks(self, rid: str, num_tokens: int) -> None:
        table = self.tables.setdefault(rid, [])
        while len(table) * BLOCK_SIZE < num_tokens:
            table.append(self.free.pop())

    def step(self, work: list[tuple[str, list[int], int]]) -> list[torch.Tensor]:
        """work: (request id, full token list, number of tokens already computed, new count)."""
        ids, positions, qlens, slens, tables = [], [], [], [], []
        for rid, tokens, done, count in work:
            self.ensure_blocks(rid, done + count)
            ids += tokens[done : done + count]
            positions += list(range(done, done + count))
            qlens.append(count)
            slens.append(done + count)
            tables.append(self.tables[rid])
        meta = AttentionMetadata.build(qlens, slens, tables, BLOCK_SIZE, "cpu")
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), meta, self.kv)
        logits = self.model.compute_logits(hidden)
        return list(torch.split(logits, qlens))


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_whole_prompts_in_one_batch(models, tiny_arch):
    ref, loaded = models(tiny_arch)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 200) for _ in range(n)] for n in (5, 17, 1, 33, 8)]
    runner = PagedRunner(loaded)
    outs = runner.step([(f"r{i}", p, 0, len(p)) for i, p in enumerate(prompts)])
    for prompt, ours in zip(prompts, outs):
        assert_close(ours, hf_logits(ref, prompt))  # every position, not just the last


def test_chunked_prefill_prefix_hit_and_decode(models, tiny_arch):
    ref, loaded = models(tiny_arch)
    rng = random.Random(2)
    new_tokens = 6
    a = [rng.randrange(3, 200) for _ in range(23)]
    prompts = {
        "a": a,
        "b": [rng.randrange(3, 200) for _ in range(9)],
        "c": [rng.randrange(3, 200) for _ in range(14)],
        # d shares a's first two blocks and starts computing after them (a prefix-cache hit).
        "d": a[: 2 * BLOCK_SIZE] + [rng.randrange(3, 200) for _ in range(6)],
    }
    seqs = {rid: hf_greedy_sequence(ref, p, new_tokens) for rid, p in prompts.items()}
    ref_logits = {rid: hf_logits(ref, seq) for rid, seq in seqs.items()}

    runner = PagedRunner(loaded, seed=3)
    done = {"a": 0, "b": 0, "c": 0}
    chunk = 7
    checked = 0
    for step in range(40):
        if step == 2:  # a's first two blocks are computed by now: d reuses them
            runner.tables["d"] = runner.tables["a"][:2]
            done["d"] = 2 * BLOCK_SIZE
        work = []
        for rid, n in done.items():
            # Prompt tokens in chunks, then one token per step (the reference's greedy token).
            limit = len(prompts[rid]) if n < len(prompts[rid]) else len(seqs[rid])
            count = min(chunk, limit - n) if n < len(prompts[rid]) else min(1, limit - n)
            if count:
                work.append((rid, seqs[rid], n, count))
        if not work:
            break
        for (rid, _, n, count), ours in zip(work, runner.step(work)):
            done[rid] = n + count
            assert_close(ours, ref_logits[rid][n : n + count])
            checked += 1
    assert all(done[rid] == len(seqs[rid]) for rid in done)
    assert checked > 20


def test_decode_rows_not_contiguous(models):
    """Decode tokens split by a prefill chunk in the flattened batch (index path)."""
    ref, loaded = models("llama")
    rng = random.Random(4)
    p1, p2, p3 = ([rng.randrange(3, 200) for _ in range(n)] for n in (6, 11, 13))
    runner = PagedRunner(loaded)
    runner.step([("x", p1, 0, 5), ("y", p2, 0, 10)])
    outs = runner.step([("x", p1, 5, 1), ("z", p3, 0, 13), ("y", p2, 10, 1)])
    for prompt, ours in zip((p1, p3, p2), outs):
        assert_close(ours[-1], hf_logits(ref, prompt)[-1])


def test_kv_cache_needs_an_even_block_size(models):
    _, loaded = models("llama")
    with pytest.raises(ValueError, match="block_size must be even"):
        allocate_kv_caches(loaded.arch, 10, 15, torch.bfloat16, "cpu")


def test_kv_cache_helpers(models):
    _, loaded = models("llama")
    arch = loaded.arch
    caches = allocate_kv_caches(arch, 10, 16, torch.bfloat16, "cpu")
    assert len(caches) == arch.num_hidden_layers
    assert caches[0].shape == (2, 10, arch.num_key_value_heads, 16 * arch.head_dim)
    per_block = kv_cache_bytes_per_block(arch, 16, torch.bfloat16)
    assert per_block * 10 == sum(c.numel() * c.element_size() for c in caches)


def test_metadata_slot_mapping():
    meta = AttentionMetadata.build([3, 1], [5, 9], [[7, 2], [4, 0, 6]], 4, "cpu")
    # request 0: positions 2..4 -> block 7 offsets 2,3 then block 2 offset 0
    # request 1: position 8 -> block 6 offset 0
    assert meta.slot_mapping.tolist() == [30, 31, 8, 24]
    assert meta.query_start_loc.tolist() == [0, 3, 4]
    assert meta.seq_lens.tolist() == [5, 9]
    assert meta.block_tables.tolist() == [[7, 2, 0], [4, 0, 6]]
    with pytest.raises(ValueError, match="blocks cannot hold"):
        AttentionMetadata.build([1], [9], [[1, 2]], 4, "cpu")

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenweir.core.kv_cache_manager import EMPTY_BLOCKS, KVCacheBlocks, KVCacheManager
from tests.core.helpers import make_request


def ids(blocks):
    return blocks.get_block_ids() if isinstance(blocks, KVCacheBlocks) else [b.block_id for b in blocks]


def admit(kv, request, num_new=None):
    hits, num_hit = kv.get_computed_blocks(request)
    num_new = request.num_tokens - num_hit if num_new is None else num_new
    blocks = kv.allocate_slots(request, num_new, hits, num_hit, apply_watermark=True)
    assert blocks is not None
    kv.record_prefix_lookup(request, num_hit)
    request.num_computed_tokens = num_hit + num_new
    kv.cache_blocks(request)  # the step ran
    return hits, num_hit


def test_prefix_hit_shares_blocks_and_counts_refs(make_kv):
    kv = make_kv(num_blocks=10, block_size=4)
    shared = list(range(100, 108))  # two full blocks
    a = make_request("a", shared + [1, 2, 3])
    b = make_request("b", shared + [7, 8, 9, 10, 11])
    admit(kv, a)
    hits, num_hit = admit(kv, b)
    assert num_hit == 8 and ids(hits) == kv.get_block_ids("a")[:2]
    assert [blk.ref_cnt for blk in hits.blocks] == [2, 2]
    assert kv.prefix_cache_stats.queries == 11 + 13 and kv.prefix_cache_stats.hits == 8
    kv.free(a)
    assert [blk.ref_cnt for blk in hits.blocks] == [1, 1]
    kv.free(b)
    assert kv.get_num_free_blocks() == 10


def test_hit_is_capped_so_the_last_token_is_computed(make_kv):
    kv = make_kv(num_blocks=10, block_size=4)
    a = make_request("a", list(range(8)))
    admit(kv, a)
    b = make_request("b", list(range(8)))  # identical, exactly two blocks
    _, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 4  # not 8: the last token must run to produce logits
    kv.free(a)


def test_cache_salt_separates_identical_prompts(make_kv):
    kv = make_kv(num_blocks=10, block_size=4)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    b = make_request("b", list(range(9)), cache_salt="tenant-b")
    assert kv.get_computed_blocks(b) == (EMPTY_BLOCKS, 0)
    kv.free(a)


def test_allocation_is_all_or_nothing_and_counts_free_hits_against_capacity(make_kv):
    kv = make_kv(num_blocks=4, block_size=4)
    a = make_request("a", list(range(8)))
    admit(kv, a)
    kv.free(a)  # both blocks free but still cached
    b = make_request("b", list(range(8)) + list(range(50, 60)))  # 18 tokens: 5 blocks
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    before = [(blk.block_id, blk.ref_cnt, blk.block_hash) for blk in kv.block_pool.blocks]
    # 2 hits (free) + 3 new blocks > 4 free: refuse and change nothing.
    assert kv.allocate_slots(b, 10, hits, num_hit) is None
    assert [(blk.block_id, blk.ref_cnt, blk.block_hash) for blk in kv.block_pool.blocks] == before
    assert "b" not in kv.req_to_blocks and kv.get_num_free_blocks() == 4
    # A smaller chunk fits: 2 hits + 1 new block.
    assert kv.allocate_slots(b, 4, hits, num_hit).num_blocks == 1
    assert kv.get_num_free_blocks() == 1
    kv.free(b)


def test_watermark_applies_only_when_asked(make_kv):
    kv = make_kv(num_blocks=10, block_size=4, watermark_blocks=2)
    a = make_request("a", 32)  # 8 blocks, leaves exactly 2 free
    assert kv.allocate_slots(a, 32, apply_watermark=True) is not None
    b = make_request("b", 4)
    assert kv.allocate_slots(b, 4, apply_watermark=True) is None
    assert kv.allocate_slots(b, 4, apply_watermark=False) is not None
    kv.free(a)
    kv.free(b)


def test_eviction_is_lru_and_frees_tail_first(make_kv):
    kv = make_kv(num_blocks=6, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7])  # blocks: [1,2] [3,4] [5,6] [7]
    admit(kv, a)
    a_blocks = kv.get_block_ids("a")
    kv.free(a)
    # Free queue: the two never-used blocks, then a's blocks tail first.
    assert ids(kv.block_pool.free_block_queue) == [4, 5] + a_blocks[::-1]
    c = make_request("c", [9, 9, 9, 9, 9, 9, 9])
    admit(kv, c)  # takes 4 blocks from the head: the 2 unused and a's two tail blocks
    assert kv.get_block_ids("c") == [4, 5] + a_blocks[::-1][:2]
    d = make_request("d", [1, 2, 3, 4, 0])
    _, num_hit = kv.get_computed_blocks(d)
    assert num_hit == 4  # a's first two blocks survived eviction
    e = make_request("e", [1, 2, 3, 4, 5, 6, 0])
    assert kv.get_computed_blocks(e)[1] == 4  # a's third block ([5,6]) was evicted
    kv.free(c)


def test_generated_tokens_fill_and_publish_blocks(make_kv):
    kv = make_kv(num_blocks=8, block_size=4)
    a = make_request("a", [1, 2, 3])
    admit(kv, a)
    a.append_output_token(4, now=0.0)  # 4 tokens: the decode step will fill block 0
    assert kv.allocate_slots(a, 1) == EMPTY_BLOCKS
    b = make_request("b", [1, 2, 3, 4, 5])
    assert kv.get_computed_blocks(b)[1] == 0  # not published before it is computed
    a.num_computed_tokens += 1
    kv.cache_blocks(a)
    assert kv.get_computed_blocks(b)[1] == 4
    kv.free(a)


def test_reset_prefix_cache_counts_and_forgets(make_kv):
    kv = make_kv(num_blocks=8, block_size=4)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    kv.reset_prefix_cache()
    assert kv.prefix_cache_stats.resets == 1
    assert kv.get_computed_blocks(make_request("b", list(range(9))))[1] == 0
    kv.free(a)
    assert kv.get_computed_blocks(make_request("c", list(range(9))))[1] == 0


def test_preempted_relookups_are_counted_apart(make_kv):
    kv = make_kv(num_blocks=8, block_size=4)
    a = make_request("a", list(range(9)))
    admit(kv, a)
    kv.free(a)
    a.num_computed_tokens = 0
    a.num_preemptions = 1
    admit(kv, a)
    s = kv.prefix_cache_stats
    assert (s.requests, s.queries, s.hits) == (1, 9, 0)
    assert (s.preempted_requests, s.preempted_queries, s.preempted_hits) == (1, 9, 8)
    kv.free(a)


@settings(max_examples=80, deadline=None)
@given(block_size=st.integers(1, 6), num_blocks=st.integers(1, 12), prompt_len=st.integers(1, 20),
       chunks=st.lists(st.integers(0, 9), min_size=1, max_size=25))
def test_allocate_slots_takes_exactly_the_blocks_the_tokens_need(block_size, num_blocks, prompt_len, chunks):
    """Reference: a request holding T tokens owns ceil(T / block_size) blocks. Growth that fits
    the last block (decode steps, checked first and inline) takes none and returns EMPTY_BLOCKS
    itself; growth past it takes the difference or, if the pool is short, nothing at all."""
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size)
    request = make_request("a", prompt_len, max_tokens=None)
    kv.allocate_slots(request, 0)  # the request gets its (empty) block table
    counted = kv._num_new_blocks
    calls = []
    kv._num_new_blocks = lambda *args: calls.append(args) or counted(*args)
    for num_new in chunks:
        num_owned, num_free = len(kv.get_block_ids("a")), kv.get_num_free_blocks()
        needed = -(-(request.num_computed_tokens + num_new) // block_size) - num_owned
        calls.clear()
        blocks = kv.allocate_slots(request, num_new)
        assert bool(calls) == (needed > 0)  # room in the last block: answered without the count
        if needed > num_free:
            assert blocks is None and len(kv.get_block_ids("a")) == num_owned
            continue
        if max(needed, 0) == 0:
            assert blocks is EMPTY_BLOCKS
        else:
            assert blocks.num_blocks == needed and kv.get_block_ids("a")[num_owned:] == blocks.get_block_ids()
        assert kv.get_num_free_blocks() == num_free - max(needed, 0)
        request.num_computed_tokens += num_new
    kv.free(request)
    assert kv.get_num_free_blocks() == num_blocks

from tokenweir.core.block_pool import FreeBlockQueue, KVBlock


def ids(blocks):
    return [b.block_id for b in blocks]


def test_free_queue_removes_from_the_middle_and_keeps_order():
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert ids(queue) == [0, 1, 3, 4] and queue.num_free_blocks == 4
    queue.append(blocks[2])
    assert ids(queue) == [0, 1, 3, 4, 2]
    assert queue.popleft() is blocks[0]
    assert ids(queue) == [1, 3, 4, 2]


def test_new_blocks_come_from_the_head_and_evict_hashes_lazily(make_pool):
    pool = make_pool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, 111)
    pool.cache_full_block(b, 222)
    pool.free_blocks([b, a])  # tail first
    # Still cached while free; free order is 2, 3, b, a.
    assert pool.get_cached_block(111) is a and pool.get_cached_block(222) is b
    assert ids(pool.free_block_queue) == [2, 3, 1, 0]
    taken = pool.get_new_blocks(3)
    assert ids(taken) == [2, 3, 1]
    assert pool.get_cached_block(222) is None and b.block_hash is None  # evicted on reuse
    assert pool.get_cached_block(111) is a
    pool.free_blocks(taken)


def test_touch_takes_a_free_cached_block_out_of_the_queue(make_pool):
    pool = make_pool(3)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_block(a, 7)
    pool.free_blocks([a])
    assert pool.get_num_free_blocks() == 3
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.get_num_free_blocks() == 2 and a not in list(pool.free_block_queue)
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free_blocks([a])
    assert pool.get_num_free_blocks() == 2
    pool.free_blocks([a])
    assert pool.get_num_free_blocks() == 3


def test_duplicate_content_keeps_the_first_cached_copy(make_pool):
    pool = make_pool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, 5)
    pool.cache_full_block(b, 5)
    assert pool.get_cached_block(5) is a and b.block_hash is None
    pool.free_blocks([a, b])


def test_reset_prefix_cache_forgets_all_hashes(make_pool):
    pool = make_pool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, 1)
    pool.cache_full_block(b, 2)
    pool.free_blocks([a])
    pool.reset_prefix_cache()
    assert pool.get_cached_block(1) is None and pool.get_cached_block(2) is None
    assert a.block_hash is None and b.block_hash is None
    pool.free_blocks([b])

"""A waiting request preempts only when that makes room for it, and never for the watermark."""

import pytest

from tests.core.helpers import PagedFakeRunner, make_request, reference_stream, run_until_done, step
from tokenweir.request import RequestStatus


@pytest.mark.parametrize("max_num_seqs", [16, 2], ids=["blocks", "slot-and-blocks"])
def test_no_preemption_for_a_request_that_still_would_not_fit(make_scheduler, max_num_seqs):
    # 8 blocks of 4: "top" (more important than "mid") holds 4, "low" holds 2, 2 are free.
    # "mid" needs 5 blocks (and, with 2 sequences, a slot): preempting "low" frees only 4, and
    # "top" may not be displaced.
    s = make_scheduler(policy="priority", num_blocks=8, max_num_seqs=max_num_seqs, max_num_batched_tokens=64)
    runner = PagedFakeRunner(s.block_size)
    top = make_request("top", 15, max_tokens=6, priority=0)
    low = make_request("low", 7, max_tokens=6, priority=9)
    s.add_request(top)
    s.add_request(low)
    step(s, runner)  # both prefilled; their next token needs no new block
    mid = make_request("mid", 18, max_tokens=1, priority=5)
    s.add_request(mid)
    out = step(s, runner)
    assert out.preempted_req_ids == set() and low.num_preemptions == 0
    assert out.num_scheduled_tokens == {"top": 1, "low": 1}
    run_until_done(s, runner)
    for r in (top, low, mid):
        assert r.output_token_ids == reference_stream(r.prompt_token_ids, r.num_output_tokens)


def test_a_waiting_request_preempts_only_the_victims_it_needs(make_scheduler):
    s = make_scheduler(policy="priority", num_blocks=8, max_num_batched_tokens=64)
    runner = PagedFakeRunner(s.block_size)
    lows = [make_request(f"low{i}", 7, max_tokens=8, priority=9, arrival_time=i) for i in range(3)]
    for r in lows:
        s.add_request(r)
    step(s, runner)  # three requests of 2 blocks: 2 blocks free
    high = make_request("high", 13, max_tokens=2, priority=0)  # 4 blocks: one victim is enough
    s.add_request(high)
    out = step(s, runner)
    assert out.preempted_req_ids == {"low2"}  # the latest of the least important
    assert [r.num_preemptions for r in lows] == [0, 0, 1]
    run_until_done(s, runner)
    for r in (*lows, high):
        assert r.output_token_ids == reference_stream(r.prompt_token_ids, r.num_output_tokens)


def test_the_watermark_does_not_evict_a_running_request(make_scheduler):
    # The case: 10 blocks, watermark 0.2 (2 blocks), "low" holds 5, "high" needs 4 of
    # the 5 free. Admitting "high" now would eat the reserve; evicting "low" for it would turn
    # a reserve for running requests into a reason to preempt them. "high" waits.
    s = make_scheduler(policy="priority", num_blocks=10, watermark=0.2, max_num_batched_tokens=64)
    runner = PagedFakeRunner(s.block_size)
    low = make_request("low", 17, max_tokens=3, priority=9)  # 5 blocks, room for 3 more tokens
    s.add_request(low)
    step(s, runner)
    high = make_request("high", 16, max_tokens=2, priority=0)  # 4 blocks
    s.add_request(high)
    out = step(s, runner)
    assert out.preempted_req_ids == set() and low.num_preemptions == 0
    assert high.status == RequestStatus.WAITING
    run_until_done(s, runner)
    assert low.num_preemptions == 0
    for r in (low, high):
        assert r.output_token_ids == reference_stream(r.prompt_token_ids, r.num_output_tokens)


def test_a_victim_whose_blocks_are_shared_frees_only_what_it_alone_holds(make_scheduler):
    """Preempting a request whose prefix another running request shares frees none of those
    blocks: the plan counts that, so it preempts nobody when the shared blocks were the point."""
    s = make_scheduler(policy="priority", num_blocks=8, max_num_batched_tokens=64)
    runner = PagedFakeRunner(s.block_size)
    shared = list(range(500, 512))  # 3 full blocks
    keep = make_request("keep", shared + [1], max_tokens=8, priority=0)
    s.add_request(keep)
    step(s, runner)
    twin = make_request("twin", shared + [2], max_tokens=8, priority=9)  # shares 3, owns 1
    s.add_request(twin)
    step(s, runner)
    assert s.kv_cache_manager.get_num_free_blocks() == 3
    # 5 new blocks: preempting "twin" would free only its own block (4 free), not enough.
    high = make_request("high", 17, max_tokens=1, priority=1)
    s.add_request(high)
    out = step(s, runner)
    assert out.preempted_req_ids == set() and twin.num_preemptions == 0
    run_until_done(s, runner)
    for r in (keep, twin, high):
        assert r.output_token_ids == reference_stream(r.prompt_token_ids, r.num_output_tokens)


def _top_and_low_decoding(s, runner, prompt_len: int, max_tokens: int):
    """"top" (priority 0) and "low" (priority 9) admitted and run until both decode."""
    top = make_request("top", prompt_len, max_tokens=max_tokens, priority=0)
    low = make_request("low", prompt_len, max_tokens=max_tokens, priority=9)
    s.add_request(top)
    s.add_request(low)
    while top.num_output_tokens == 0 or low.num_output_tokens == 0:
        step(s, runner)
    return top, low


def test_a_chunked_prompt_preempts_only_for_room_for_the_whole_prompt(make_scheduler):
    # 8 blocks of 4, prefill chunks of 2 tokens: "top" and "low" hold 4 blocks each and decode
    # their last token inside them. "mid"'s first chunk (1 block) would fit once "low" is gone,
    # but its whole prompt (5 blocks) never fits beside "top": preempting "low" for the chunk
    # would only make "mid" preempt again, or preempt itself, at its next chunks.
    s = make_scheduler(policy="priority", num_blocks=8, max_num_batched_tokens=64, long_prefill_token_threshold=2,
                       enable_prefix_caching=False)
    runner = PagedFakeRunner(s.block_size)
    top, low = _top_and_low_decoding(s, runner, 15, 2)
    mid = make_request("mid", 18, max_tokens=1, priority=5)
    s.add_request(mid)
    out = step(s, runner)
    assert out.preempted_req_ids == set() and low.num_preemptions == 0
    assert mid.status == RequestStatus.WAITING
    run_until_done(s, runner)
    for r in (top, low, mid):
        assert r.output_token_ids == reference_stream(r.prompt_token_ids, r.num_output_tokens)


def test_a_victim_is_not_readmitted_in_the_step_that_preempted_it(make_scheduler):
    # 8 blocks of 4, budget 16: "top" and "low" hold 4 blocks each (their tokens up to the
    # 16th fit in them), none is free. "high" preempts "low" for its 2 blocks; 2 blocks and 8 tokens of budget are left, enough for a
    # first chunk of "low", back at the queue's front. Taking it in would spend the room just
    # made on the request preempted to make it.
    s = make_scheduler(policy="priority", num_blocks=8, max_num_batched_tokens=16, watermark=0.0,
                       preemption_mode="recompute", enable_prefix_caching=False)
    runner = PagedFakeRunner(s.block_size)
    top, low = _top_and_low_decoding(s, runner, 14, 3)
    high = make_request("high", 7, max_tokens=1, priority=0)
    s.add_request(high)
    out = step(s, runner)
    assert out.preempted_req_ids == {"low"}
    assert "low" not in out.num_scheduled_tokens and out.num_scheduled_tokens["high"] == 7
    run_until_done(s, runner)
    for r in (top, low, high):
        assert r.output_token_ids == reference_stream(r.prompt_token_ids, r.num_output_tokens)

"""Swap preemption in the scheduler and the KV cache manager's host tier: scripted scenarios with
the paged fake runner (which copies blocks between its fake device and host caches as the
SchedulerOutput says, so a wrong pair or a missed copy changes the output stream)."""

from __future__ import annotations

import pytest

from tests.core.helpers import PagedFakeRunner, make_request, reference_stream, step
from tokenweir.core.cost_model import FEATURES, StepCostModel
from tokenweir.core.scheduler import CachedRequestData
from tokenweir.request import RequestStatus


def run_steps(s, runner, num_steps=None, start=0):
    outs = []
    t = start
    while s.has_unfinished_requests() and (num_steps is None or t < start + num_steps):
        outs.append(step(s, runner, now=float(t)))
        t += 1
        assert t < 1000, "no progress"
    return outs


def three_requests(make_scheduler, **kwargs):
    """Three 7-token prompts on 7 blocks of 4: the growth of the first two pushes out the
    third, then the second."""
    s = make_scheduler(num_blocks=7, block_size=4, preemption_mode="swap", num_host_blocks=16, **kwargs)
    reqs = [make_request(f"r{i}", 7, max_tokens=8) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    return s, reqs


def assert_streams_exact(reqs, num_tokens=8):
    for r in reqs:
        assert r.output_token_ids == reference_stream(r.prompt_token_ids, num_tokens), r.request_id


def test_swap_out_copies_computed_blocks_and_frees_the_device_ones_at_once(make_scheduler):
    s, (r0, r1, r2) = three_requests(make_scheduler)
    runner = PagedFakeRunner(4)
    run_steps(s, runner, 2)
    assert s.kv_cache_manager.get_block_ids("r2") == [4, 5]
    out = step(s, runner, now=2.0)
    # r1 needs a third block: the last running request (r2, 8 tokens computed) is swapped out.
    assert out.preempted_req_ids == {"r2"} and out.blocks_to_swap_out == [(4, 0), (5, 1)]
    assert out.blocks_to_swap_in == [] and "r2" not in out.num_scheduled_tokens
    assert r2.status == RequestStatus.SWAPPED and r2.num_computed_tokens == 8
    kv = s.kv_cache_manager
    assert "r2" not in kv.req_to_blocks and [b.block_id for b in kv.req_to_host_blocks["r2"]] == [0, 1]
    assert kv.get_num_free_host_blocks() == 14
    stats = s.get_stats()
    assert (stats.num_swapped, stats.num_blocks_swapped_out, stats.num_preemptions) == (1, 2, 1)
    assert stats.num_preemptions_by_mode == {"recompute": 0, "swap": 1}
    assert stats.swap_space_usage == pytest.approx(2 / 16)
    run_steps(s, runner, start=3)
    assert_streams_exact([r0, r1, r2])
    stats = s.get_stats()
    assert stats.num_preemptions_by_mode == {"recompute": 0, "swap": 2} and stats.num_swapped == 0
    # Nothing was recomputed: each token's K/V was computed once.
    assert all(r.max_computed_tokens == r.num_tokens - 1 for r in (r0, r1, r2))


def test_swap_in_returns_computed_tokens_and_reuses_blocks_still_cached(make_scheduler):
    s, (r0, r1, r2) = three_requests(make_scheduler)
    runner = PagedFakeRunner(4)
    outs = run_steps(s, runner, 9)
    swap_out = next(o for o in outs if "r1" in o.preempted_req_ids)
    assert swap_out.blocks_to_swap_out == [(2, 2), (3, 3), (5, 4)]  # 12 computed tokens
    swap_in = outs[-1]
    # r1's three full blocks were published and are still cached (free, with their keys): it
    # takes them back without a copy; r2's blocks were reused meanwhile and are copied in.
    new = {n.request_id: n for n in swap_in.scheduled_new_reqs}
    assert new["r1"].block_ids[:3] == [2, 3, 5] and new["r1"].num_computed_tokens == 12
    assert new["r2"].num_computed_tokens == 8
    assert swap_in.blocks_to_swap_in == [(new["r2"].block_ids[0], 0), (new["r2"].block_ids[1], 1)]
    assert swap_in.num_scheduled_tokens == {"r1": 1, "r2": 1}
    assert s.get_stats().num_blocks_swapped_in == 2
    run_steps(s, runner, start=9)
    assert_streams_exact([r0, r1, r2])


def test_a_shared_block_is_copied_out_and_found_in_the_cache_on_return(make_scheduler):
    s = make_scheduler(num_blocks=6, block_size=4, preemption_mode="swap", num_host_blocks=16)
    runner = PagedFakeRunner(4)
    shared = list(range(500, 508))  # two full blocks
    a = make_request("a", shared + [600], max_tokens=12)
    b = make_request("b", shared + [700], max_tokens=12)
    s.add_request(a)
    step(s, runner, now=0.0)
    s.add_request(b)
    step(s, runner, now=1.0)
    kv = s.kv_cache_manager
    shared_ids = kv.get_block_ids("a")[:2]
    assert kv.get_block_ids("b")[:2] == shared_ids and kv.get_num_shared_blocks(b) == 2
    t = 2
    while b.status != RequestStatus.SWAPPED:
        out = step(s, runner, now=float(t))
        t += 1
    # b goes out whole, its shared prefix too (so it depends on no block it does not hold);
    # the prefix stays on the device, held by a.
    assert [d for d, _ in out.blocks_to_swap_out][:2] == shared_ids
    assert [blk.ref_cnt for blk in kv.req_to_blocks["a"][:2]] == [1, 1]
    while b.status == RequestStatus.SWAPPED:
        out = step(s, runner, now=float(t))
        t += 1
    new_b = next(n for n in out.scheduled_new_reqs if n.request_id == "b")
    assert new_b.block_ids[:2] == shared_ids
    assert out.blocks_to_swap_in and all(d not in shared_ids for d, _ in out.blocks_to_swap_in)
    run_steps(s, runner, start=t)
    assert a.output_token_ids == reference_stream(a.prompt_token_ids, 12)
    assert b.output_token_ids == reference_stream(b.prompt_token_ids, 12)


@pytest.mark.parametrize("chunked", [True, False])
def test_nothing_swaps_in_during_a_step_that_swapped_out(make_scheduler, chunked):
    """A scenario (found by search) in which, once r1's growth swaps out r3 in step 14, the
    swapped r2 would fit into r3's freed blocks: it must wait for the next step (vllm#5578)."""
    s = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=64, policy="priority",
                       preemption_mode="swap", num_host_blocks=32, enable_chunked_prefill=chunked,
                       max_model_len=None if chunked else 64)
    runner = PagedFakeRunner(4)
    specs = [("r0", 10, 11, 3, 0.0, 6), ("r1", 2, 12, 0, 0.0, 3), ("r2", 10, 7, 1, 2.0, 2),
             ("r3", 4, 6, 1, 0.0, 1)]  # id, prompt, max_tokens, priority, arrival, added at step
    reqs, swapped_both_ways, t = [], [], 0
    while t < 200 and (len(reqs) < len(specs) or s.has_unfinished_requests()):
        for rid, prompt, max_tokens, priority, arrival, at in specs:
            if at == t:
                reqs.append(make_request(rid, prompt, max_tokens=max_tokens, priority=priority,
                                         arrival_time=arrival))
                s.add_request(reqs[-1])
        swapped_before = [r.request_id for r in s.swapped]
        out = s.schedule(now=float(t))
        if out.blocks_to_swap_out:
            swapped_both_ways.append((t, swapped_before, out.blocks_to_swap_in))
        s.update_from_output(out, runner.execute(out), now=float(t))
        t += 1
    assert any(before for _, before, _ in swapped_both_ways), "the scenario no longer swaps out beside a swapped request"
    assert all(swap_in == [] for _, _, swap_in in swapped_both_ways)
    max_tokens = {rid: n for rid, _, n, *_ in specs}
    for r in reqs:
        assert r.output_token_ids == reference_stream(r.prompt_token_ids, max_tokens[r.request_id])


def test_no_waiting_request_is_admitted_while_an_older_one_is_swapped_out(make_scheduler):
    s = make_scheduler(num_blocks=6, block_size=4, preemption_mode="swap", num_host_blocks=16)
    runner = PagedFakeRunner(4)
    a = make_request("a", 8, max_tokens=12, arrival_time=0.0)
    b = make_request("b", 8, max_tokens=12, arrival_time=1.0)
    s.add_request(a)
    s.add_request(b)
    run_steps(s, runner, 2)
    t = 2
    while b.status != RequestStatus.SWAPPED:
        step(s, runner, now=float(t))
        t += 1
    # b (3 blocks) waits for room; a one-block newcomer would fit now, but b is older.
    late = make_request("late", 2, max_tokens=2, arrival_time=5.0)
    s.add_request(late)
    assert s.kv_cache_manager.get_num_free_blocks() >= 1
    while b.status == RequestStatus.SWAPPED:
        out = step(s, runner, now=float(t))
        t += 1
        assert "late" not in out.num_scheduled_tokens or b.status == RequestStatus.RUNNING
    run_steps(s, runner, start=t)
    assert b.output_token_ids == reference_stream(b.prompt_token_ids, 12)


def test_an_older_waiting_request_is_admitted_beside_a_swapped_one(make_scheduler):
    """A recompute victim (or any request that arrived first) is older than a request swapped
    out after it: it may run."""
    s = make_scheduler(num_blocks=6, block_size=4, preemption_mode="swap", num_host_blocks=16)
    runner = PagedFakeRunner(4)
    a = make_request("a", 8, max_tokens=12, arrival_time=0.0)
    b = make_request("b", 8, max_tokens=12, arrival_time=2.0)
    s.add_request(a)
    s.add_request(b)
    t = 0
    while b.status != RequestStatus.SWAPPED:
        step(s, runner, now=float(t))
        t += 1
    older = make_request("older", 2, max_tokens=2, arrival_time=1.0)
    s.add_request(older)
    out = step(s, runner, now=float(t))
    assert "older" in out.num_scheduled_tokens and b.status == RequestStatus.SWAPPED
    run_steps(s, runner, start=t + 1)


def test_aborting_a_swapped_request_frees_its_host_blocks(make_scheduler):
    s, (r0, r1, r2) = three_requests(make_scheduler)
    runner = PagedFakeRunner(4)
    run_steps(s, runner, 3)
    assert r2.status == RequestStatus.SWAPPED
    kv = s.kv_cache_manager
    assert kv.get_num_free_host_blocks() == 14
    s.abort_requests(["r2"], now=3.0)
    assert r2.status == RequestStatus.FINISHED_ABORTED and len(s.swapped) == 0
    assert kv.get_num_free_host_blocks() == 16 and "r2" not in kv.req_to_host_blocks
    out = step(s, runner, now=3.0)
    assert "r2" in out.finished_req_ids
    run_steps(s, runner, start=4)
    assert_streams_exact([r0, r1])


def test_swap_space_exhausted_falls_back_to_recompute(make_scheduler):
    # One host block: no victim (two or three blocks computed) can go out; each is recomputed,
    # and nothing fails.
    s = make_scheduler(num_blocks=7, block_size=4, preemption_mode="swap", num_host_blocks=1)
    reqs = [make_request(f"r{i}", 7, max_tokens=8) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    runner = PagedFakeRunner(4)
    outs = run_steps(s, runner)
    assert all(o.blocks_to_swap_out == [] for o in outs)
    stats = s.get_stats()
    assert stats.num_preemptions_by_mode["recompute"] >= 1 and stats.num_preemptions_by_mode["swap"] == 0
    assert_streams_exact(reqs)


def test_swap_space_full_of_one_victim_recomputes_the_next(make_scheduler):
    # Three host blocks: r2 goes out (two), then r1 (three) finds no room and is recomputed.
    s = make_scheduler(num_blocks=7, block_size=4, preemption_mode="swap", num_host_blocks=3)
    reqs = [make_request(f"r{i}", 7, max_tokens=8) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    runner = PagedFakeRunner(4)
    run_steps(s, runner)
    assert s.get_stats().num_preemptions_by_mode == {"recompute": 1, "swap": 1}
    assert_streams_exact(reqs)


def test_a_failed_step_recomputes_the_requests_it_swapped_out(make_scheduler):
    s, (r0, r1, r2) = three_requests(make_scheduler)
    runner = PagedFakeRunner(4)
    run_steps(s, runner, 2)
    out = s.schedule(now=2.0)
    assert out.blocks_to_swap_out  # r2 goes out; the step never runs, so its copies never happen
    failed = s.fail_step(out, now=2.0)
    assert {r.request_id for r in failed} == {"r0", "r1"}
    assert r2.status == RequestStatus.PREEMPTED and r2.num_computed_tokens == 0
    assert "r2" not in s.kv_cache_manager.req_to_host_blocks and len(s.swapped) == 0
    runner.execute(out.__class__(**{**vars(out), "num_scheduled_tokens": {}, "scheduled_new_reqs": [],
                                    "scheduled_cached_reqs": CachedRequestData(), "blocks_to_swap_out": []}))
    run_steps(s, runner, start=3)
    assert_streams_exact([r2])


def cost_model(seconds_per_token: float, swap_bytes_per_second: float) -> StepCostModel:
    coefficients = dict.fromkeys(FEATURES, 0.0)
    coefficients["tokens"] = seconds_per_token
    return StepCostModel(coefficients, swap_bytes_per_second)


@pytest.mark.parametrize("bandwidth, expected", [(1e9, "swap"), (1e3, "recompute")])
def test_auto_takes_the_cheaper_preemption(make_scheduler, bandwidth, expected):
    # Each victim: 8 or 12 computed tokens at 1 ms each, against 2-3 blocks of 1 kB out and
    # in: at 1 GB/s swapping is far cheaper; at 1 kB/s far dearer.
    s = make_scheduler(num_blocks=7, block_size=4, preemption_mode="auto", num_host_blocks=16,
                       kv_block_bytes=1000, cost_model=cost_model(1e-3, bandwidth))
    reqs = [make_request(f"r{i}", 7, max_tokens=8) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    runner = PagedFakeRunner(4)
    run_steps(s, runner)
    by_mode = s.get_stats().num_preemptions_by_mode
    assert by_mode[expected] == s.num_preemptions >= 2
    assert_streams_exact(reqs)


def test_auto_recomputes_short_contexts_and_swaps_long_ones(make_scheduler):
    """A prefill's cost grows faster than its context (attention reads every earlier token);
    a copy's cost grows with the blocks. Here a block out and back in costs 5 ms, a token's
    prefill 1 ms plus 0.1 ms per query-key pair: the choice flips at 8 computed tokens."""
    coefficients = dict.fromkeys(FEATURES, 0.0)
    coefficients.update(tokens=1e-3, prefill_attention=1e-4)
    s = make_scheduler(num_blocks=64, block_size=4, preemption_mode="auto", num_host_blocks=64,
                       kv_block_bytes=1000, cost_model=StepCostModel(coefficients, 2 * 1000 / 5e-3))
    chooser = s.preemption
    for length, expected in [(3, "recompute"), (7, "recompute"), (8, "swap"), (40, "swap")]:
        # The chooser reads counts only: a request with `length` tokens computed, none shared.
        r = make_request(f"len{length}", length + 1, max_tokens=1)
        r.num_computed_tokens = length
        assert chooser.choose(r) == expected, (length, chooser.recompute_seconds(r), chooser.swap_seconds(r))


def test_auto_prices_the_prefix_other_requests_hold_as_cached(make_scheduler):
    s = make_scheduler(num_blocks=16, block_size=4, preemption_mode="auto", num_host_blocks=16,
                       kv_block_bytes=1000, cost_model=cost_model(1e-3, 1e6))
    runner = PagedFakeRunner(4)
    shared = list(range(500, 516))  # four full blocks
    a = make_request("a", shared + [1], max_tokens=4)
    b = make_request("b", shared + [2], max_tokens=4)
    s.add_request(a)
    step(s, runner, now=0.0)
    s.add_request(b)
    step(s, runner, now=1.0)
    chooser = s.preemption
    # b: 17 computed tokens, 16 of them in blocks a holds too: recompute is one token's prefill
    # after 16 cached; swap copies 5 blocks out and 1 back in.
    assert chooser.recompute_seconds(b) == pytest.approx(1e-3)
    assert chooser.swap_seconds(b) == pytest.approx(6 * 1000 / 1e6)
    assert chooser.choose(b) == "recompute"
    run_steps(s, runner, start=2)


def test_a_victim_of_a_step_that_swapped_in_is_recomputed(make_scheduler):
    """A scenario (found by search): in step 6 r0 swaps back in, then the high-priority r1,
    older than nothing swapped, preempts to be admitted. Its victim is recomputed: a swap-out
    in that step could take the very blocks the swap-in copies from or into."""
    s = make_scheduler(num_blocks=3, block_size=4, policy="priority", preemption_mode="swap",
                       num_host_blocks=32)
    runner = PagedFakeRunner(4)
    specs = {1: ("r2", 10, 5, 1, 2.0), 2: ("r0", 8, 4, 0, 0.0), 5: ("r1", 7, 9, 0, 3.0)}
    reqs, mixed_steps, t = [], [], 0
    while t < 100 and (len(reqs) < len(specs) or s.has_unfinished_requests()):
        if t in specs:
            rid, prompt, max_tokens, priority, arrival = specs[t]
            reqs.append(make_request(rid, prompt, max_tokens=max_tokens, priority=priority, arrival_time=arrival))
            s.add_request(reqs[-1])
        out = s.schedule(now=float(t))
        if out.blocks_to_swap_in and out.preempted_req_ids:
            mixed_steps.append({rid: s.requests[rid].status for rid in out.preempted_req_ids})
        s.update_from_output(out, runner.execute(out), now=float(t))  # refuses both ways
        t += 1
    assert mixed_steps, "the scenario no longer preempts in a step that swapped in"
    assert all(status == RequestStatus.PREEMPTED for step_ in mixed_steps for status in step_.values())
    max_tokens = {rid: n for rid, _, n, *_ in specs.values()}
    for r in reqs:  # r2 reaches the pool's 12 tokens first
        n = max_tokens[r.request_id] if r.num_tokens < s.max_model_len else r.num_output_tokens
        assert r.output_token_ids == reference_stream(r.prompt_token_ids, n)


def test_an_fcfs_swapped_queue_returns_requests_in_arrival_order(make_scheduler):
    s = make_scheduler(num_blocks=9, block_size=4, preemption_mode="swap", num_host_blocks=32)
    runner = PagedFakeRunner(4)
    reqs = [make_request(f"r{i}", 7, max_tokens=16, arrival_time=float(i)) for i in range(4)]
    for r in reqs:
        s.add_request(r)
    seen, t = [], 0
    while s.has_unfinished_requests():
        step(s, runner, now=float(t))
        t += 1
        if len(s.swapped) > 1:
            seen.append([r.request_id for r in s.swapped])
    assert seen and all(order == sorted(order) for order in seen)
    for r in reqs:
        assert r.output_token_ids == reference_stream(r.prompt_token_ids, 16)


def test_swap_in_copies_a_partly_computed_block_back_rather_than_take_a_cached_one(make_scheduler):
    # B is swapped out mid-chunk with 6 of its 8 shared prefix tokens computed; A then finishes
    # and publishes that prefix's second block. Swapping in, B may take cached blocks only for
    # what it had computed whole: its second block gets its own copy (positions 6 and 7 are
    # still to be written), not A's published block (a review's case: B wrote into it).
    from tokenweir.request import Request, SamplingParams
    s = make_scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=6, max_num_seqs=2,
                       long_prefill_token_threshold=3, preemption_mode="swap", num_host_blocks=8)
    shared = list(range(100, 108))
    a = Request("A", shared + [200, 201, 202, 203], SamplingParams(max_tokens=6, ignore_eos=True), eos_token_id=2)
    b = Request("B", shared + [300, 301, 302, 303], SamplingParams(max_tokens=2, ignore_eos=True), eos_token_id=2)
    s.add_request(a)
    s.add_request(b)
    runner = PagedFakeRunner(4)
    outs = run_steps(s, runner)  # step() checks every write lands in a block of its own
    swapped_in = [out.blocks_to_swap_in for out in outs if out.blocks_to_swap_in]
    # Its first block, computed whole, is A's cached one; its second is copied back.
    assert swapped_in and len(swapped_in[0]) == 1
    assert s.get_stats().num_preemptions_by_mode["swap"] >= 1
    assert a.output_token_ids == reference_stream(a.prompt_token_ids, 6)
    assert b.output_token_ids == reference_stream(b.prompt_token_ids, 2)

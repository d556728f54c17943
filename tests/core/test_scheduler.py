"""Scenario tests of the scheduler: scripted steps with the paged fake runner."""

import pytest

from tokenweir.request import RequestStatus
from tests.core.helpers import EOS, PagedFakeRunner, make_request, reference_stream, run_until_done, step


def sched_ids(out):
    return list(out.num_scheduled_tokens)


def test_fcfs_admits_in_arrival_order_within_seq_cap(make_scheduler):
    s = make_scheduler(max_num_seqs=2)
    runner = PagedFakeRunner(s.block_size)
    for i, rid in enumerate("abc"):
        s.add_request(make_request(rid, 5, arrival_time=i))
    out = step(s, runner)
    assert sched_ids(out) == ["a", "b"] and [r.request_id for r in s.waiting] == ["c"]
    run_until_done(s, runner)


def test_chunk_sizes_follow_budget_and_long_prefill_threshold(make_scheduler):
    s = make_scheduler(max_num_batched_tokens=10, long_prefill_token_threshold=6)
    runner = PagedFakeRunner(s.block_size)
    s.add_request(make_request("a", 20, max_tokens=2))
    s.add_request(make_request("b", 3, max_tokens=2))
    out = step(s, runner)
    assert out.num_scheduled_tokens == {"a": 6, "b": 3}  # a capped by the threshold
    out = step(s, runner)
    assert out.num_scheduled_tokens == {"a": 6, "b": 1}  # b decodes
    out = step(s, runner)
    assert out.num_scheduled_tokens == {"a": 6}  # b finished (max_tokens=2)
    out = step(s, runner)
    assert out.num_scheduled_tokens == {"a": 2}  # the rest of the prompt; a's first token
    assert s.requests["a"].num_output_tokens == 1
    run_until_done(s, runner)


def test_chunked_prefill_splits_to_the_remaining_budget(make_scheduler):
    s = make_scheduler(max_num_batched_tokens=8)
    runner = PagedFakeRunner(s.block_size)
    s.add_request(make_request("a", 5, max_tokens=3))
    s.add_request(make_request("b", 12, max_tokens=3))
    out = step(s, runner)
    assert out.num_scheduled_tokens == {"a": 5, "b": 3}
    out = step(s, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 7}
    run_until_done(s, runner)


def test_without_chunking_a_prompt_waits_whole_and_blocks_the_queue(make_scheduler):
    s = make_scheduler(max_num_batched_tokens=10, enable_chunked_prefill=False, max_model_len=10)
    runner = PagedFakeRunner(s.block_size)
    s.add_request(make_request("a", 4, max_tokens=3))
    s.add_request(make_request("b", 8, max_tokens=3))
    s.add_request(make_request("c", 2, max_tokens=3))
    out = step(s, runner)
    # b does not fit in the 6 tokens left and is not chunked; c behind it waits (strict FCFS).
    assert out.num_scheduled_tokens == {"a": 4}
    out = step(s, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 8}  # c (2) still does not fit in 1
    out = step(s, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1, "c": 2}
    run_until_done(s, runner)


@pytest.mark.parametrize("kind", ["eos", "ignore_eos", "stop_token", "max_tokens", "min_tokens", "max_model_len"])
def test_stop_conditions(make_scheduler, kind):
    s = make_scheduler(max_model_len=12 if kind == "max_model_len" else None)
    script = iter([5, EOS, 6, 7, 8, 9, 10, 11])
    runner = PagedFakeRunner(s.block_size, token_fn=lambda ctx: next(script))
    params = {
        "eos": dict(max_tokens=8),
        "ignore_eos": dict(max_tokens=4, ignore_eos=True),
        "stop_token": dict(max_tokens=8, stop_token_ids=[7], ignore_eos=True),
        "max_tokens": dict(max_tokens=3, ignore_eos=True),
        "min_tokens": dict(max_tokens=8, min_tokens=3, stop_token_ids=[6]),
        "max_model_len": dict(max_tokens=None, ignore_eos=True),
    }[kind]
    r = make_request("r", 8, **params)
    s.add_request(r)
    run_until_done(s, runner)
    expected = {
        "eos": ([5, EOS], RequestStatus.FINISHED_STOPPED, None),
        "ignore_eos": ([5, EOS, 6, 7], RequestStatus.FINISHED_LENGTH, None),
        "stop_token": ([5, EOS, 6, 7], RequestStatus.FINISHED_STOPPED, 7),
        "max_tokens": ([5, EOS, 6], RequestStatus.FINISHED_LENGTH, None),
        # EOS as the 2nd token is ignored (min 3); stop id 6 as the 3rd token counts.
        "min_tokens": ([5, EOS, 6], RequestStatus.FINISHED_STOPPED, 6),
        "max_model_len": ([5, EOS, 6, 7], RequestStatus.FINISHED_LENGTH, None),
    }[kind]
    assert (r.output_token_ids, r.status, r.stop_reason) == expected
    assert r.finish_reason == ("stop" if expected[1] == RequestStatus.FINISHED_STOPPED else "length")


def test_min_tokens_then_stop_token(make_scheduler):
    s = make_scheduler()
    script = iter([6, 5, 6, 9])
    runner = PagedFakeRunner(s.block_size, token_fn=lambda ctx: next(script))
    r = make_request("r", 4, max_tokens=8, min_tokens=2, stop_token_ids=[6])
    s.add_request(r)
    run_until_done(s, runner)
    assert r.output_token_ids == [6, 5, 6] and r.stop_reason == 6


def test_fcfs_preempts_the_last_running_and_resumes_without_loss(make_scheduler):
    # 6 blocks of 4 tokens. a and b each need 2 blocks for their prompts, then grow.
    s = make_scheduler(num_blocks=6, max_num_batched_tokens=32)
    runner = PagedFakeRunner(s.block_size)
    a = make_request("a", 7, max_tokens=10, arrival_time=0)
    b = make_request("b", 7, max_tokens=10, arrival_time=1)
    s.add_request(a)
    s.add_request(b)
    preempted_steps = []
    while s.has_unfinished_requests():
        out = step(s, runner)
        if out.preempted_req_ids:
            preempted_steps.append(set(out.preempted_req_ids))
    assert preempted_steps and preempted_steps[0] == {"b"}  # the last admitted goes first
    assert b.num_preemptions >= 1 and a.num_preemptions == 0
    for r in (a, b):
        assert r.output_token_ids == reference_stream(r.prompt_token_ids, 10)
    assert s.get_stats().num_preemptions == b.num_preemptions
    # Re-admitted, b found its own blocks in the prefix cache, but num_cached_tokens reports
    # what its first admission found.
    assert s.kv_cache_manager.prefix_cache_stats.preempted_hits > 0 and b.num_cached_tokens == 0


def test_preempted_request_goes_to_the_front_of_waiting(make_scheduler):
    s = make_scheduler(num_blocks=4, max_num_batched_tokens=32, max_num_seqs=2)
    runner = PagedFakeRunner(s.block_size)
    s.add_request(make_request("a", 7, max_tokens=8))
    s.add_request(make_request("b", 7, max_tokens=8))
    s.add_request(make_request("c", 3, max_tokens=8))
    step(s, runner)  # a and b take all 4 blocks
    step(s, runner)  # both decode their 8th token
    out = step(s, runner)  # a needs a 3rd block for its 9th token: b is preempted
    assert out.preempted_req_ids == {"b"}
    assert [r.request_id for r in s.waiting] == ["b", "c"]
    assert s.requests["b"].status == RequestStatus.PREEMPTED
    run_until_done(s, runner)


def test_priority_preempts_lowest_priority_and_unwinds_a_victim_scheduled_this_step(make_scheduler):
    s = make_scheduler(policy="priority", num_blocks=6, max_num_batched_tokens=64)
    runner = PagedFakeRunner(s.block_size)
    low = make_request("low", 5, max_tokens=12, priority=5, arrival_time=0)
    high = make_request("high", 7, max_tokens=12, priority=0, arrival_time=1)
    s.add_request(low)
    step(s, runner)
    s.add_request(high)
    out = step(s, runner)
    assert [r.request_id for r in s.running] == ["low", "high"]
    # Both grow until the pool is exhausted. "high" is the first to need a block that is not
    # there; "low" asked first in that step and already got its token, which is handed back.
    while not out.preempted_req_ids:
        out = step(s, runner)
    assert out.preempted_req_ids == {"low"} and list(out.num_scheduled_tokens) == ["high"]
    assert out.total_num_scheduled_tokens == 1
    run_until_done(s, runner)
    assert low.num_preemptions >= 1 and high.num_preemptions == 0
    for r in (low, high):
        assert r.output_token_ids == reference_stream(r.prompt_token_ids, 12)


def test_higher_priority_waiting_preempts_running_when_seqs_run_out(make_scheduler):
    s = make_scheduler(policy="priority", max_num_seqs=1)
    runner = PagedFakeRunner(s.block_size)
    low = make_request("low", 4, max_tokens=6, priority=3, arrival_time=0)
    s.add_request(low)
    step(s, runner)
    high = make_request("high", 4, max_tokens=6, priority=1, arrival_time=1)
    s.add_request(high)
    out = step(s, runner)
    assert out.preempted_req_ids == {"low"} and list(out.num_scheduled_tokens) == ["high"]
    same = make_request("same", 4, max_tokens=6, priority=1, arrival_time=2)
    s.add_request(same)
    out = step(s, runner)
    assert list(out.num_scheduled_tokens) == ["high"]  # equal priority, later: no preemption
    run_until_done(s, runner)
    assert low.output_token_ids == reference_stream(low.prompt_token_ids, 6)


def test_higher_priority_waiting_preempts_running_when_blocks_run_out(make_scheduler):
    s = make_scheduler(policy="priority", num_blocks=4)
    runner = PagedFakeRunner(s.block_size)
    low = make_request("low", 12, max_tokens=4, priority=3, arrival_time=0)  # 3 blocks
    s.add_request(low)
    step(s, runner)
    high = make_request("high", 8, max_tokens=4, priority=0, arrival_time=1)  # needs 2 (+1)
    s.add_request(high)
    out = step(s, runner)
    assert out.preempted_req_ids == {"low"} and "high" in out.num_scheduled_tokens
    run_until_done(s, runner)


def test_fcfs_waiting_request_never_preempts(make_scheduler):
    s = make_scheduler(max_num_seqs=1)
    runner = PagedFakeRunner(s.block_size)
    s.add_request(make_request("a", 4, max_tokens=3))
    step(s, runner)
    s.add_request(make_request("b", 4, max_tokens=3, priority=-10))
    out = step(s, runner)
    assert list(out.num_scheduled_tokens) == ["a"] and not out.preempted_req_ids
    run_until_done(s, runner)


def test_watermark_holds_back_admission_but_not_running_growth(make_scheduler):
    s = make_scheduler(num_blocks=10, watermark=0.2)  # keep 2 blocks free on admission
    runner = PagedFakeRunner(s.block_size)
    s.add_request(make_request("a", 24, max_tokens=12))  # 6 blocks: 4 free left
    s.add_request(make_request("b", 8, max_tokens=2))  # 2 blocks: would leave 2 -> ok
    s.add_request(make_request("c", 4, max_tokens=2))  # 1 block: would leave 1 < 2 -> wait
    out = step(s, runner)
    assert list(out.num_scheduled_tokens) == ["a", "b"]
    assert s.kv_cache_manager.get_num_free_blocks() == 2
    # Both running requests decode into the two reserved blocks while c keeps waiting.
    out = s.schedule()
    kv = s.kv_cache_manager
    assert len(kv.get_block_ids("a")) == 7 and len(kv.get_block_ids("b")) == 3
    assert kv.get_num_free_blocks() == 0 and [r.request_id for r in s.waiting] == ["c"]
    s.update_from_output(out, runner.execute(out))
    run_until_done(s, runner)


def test_watermark_does_not_apply_to_an_empty_engine(make_scheduler):
    s = make_scheduler(num_blocks=4, watermark=0.5)
    runner = PagedFakeRunner(s.block_size)
    s.add_request(make_request("a", 15, max_tokens=1))  # needs all 4 blocks
    out = step(s, runner)
    assert out.num_scheduled_tokens == {"a": 15}
    run_until_done(s, runner)


def test_prefix_cache_hit_skips_computed_tokens(make_scheduler):
    s = make_scheduler()
    runner = PagedFakeRunner(s.block_size)
    shared = list(range(500, 510))  # 2 full blocks + 2 tokens
    a = make_request("a", shared + [1], max_tokens=2)
    s.add_request(a)
    run_until_done(s, runner)
    b = make_request("b", shared + [2, 3], max_tokens=2)
    s.add_request(b)
    out = step(s, runner)
    assert out.num_scheduled_tokens == {"b": 12 - 8}
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8 and b.num_cached_tokens == 8
    run_until_done(s, runner)
    assert b.output_token_ids == reference_stream(b.prompt_token_ids, 2)
    stats = s.get_stats().prefix_cache
    assert (stats.queries, stats.hits) == (11 + 12, 8)


def test_prefix_cache_disabled_never_hits(make_scheduler):
    s = make_scheduler(enable_prefix_caching=False)
    runner = PagedFakeRunner(s.block_size)
    for rid in "ab":
        s.add_request(make_request(rid, list(range(20)), max_tokens=2))
        run_until_done(s, runner)
        assert s.get_stats().prefix_cache.hits == 0


def test_a_later_request_shares_the_blocks_an_earlier_one_computed(make_scheduler):
    s = make_scheduler(max_num_batched_tokens=64)
    runner = PagedFakeRunner(s.block_size)
    prompt = list(range(300, 317))
    a = make_request("a", prompt, max_tokens=3)
    s.add_request(a)
    out = step(s, runner)
    b = make_request("b", prompt, max_tokens=3)
    s.add_request(b)
    out = step(s, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}  # b hit 16 tokens, computes the last
    assert s.kv_cache_manager.get_block_ids("b")[:4] == s.kv_cache_manager.get_block_ids("a")[:4]
    run_until_done(s, runner)
    assert a.output_token_ids == b.output_token_ids == reference_stream(prompt, 3)


def test_requests_of_one_step_compute_the_same_prefix_apart_and_only_the_first_is_published(make_scheduler):
    """Nothing is published before a step has run, so two identical prompts admitted in the same
    step both compute it; the first copy becomes the cached one, the second stays private, and a
    third request hits the first copy."""
    s = make_scheduler(max_num_batched_tokens=64)
    runner = PagedFakeRunner(s.block_size)
    prompt = list(range(300, 317))
    a, b = make_request("a", prompt, max_tokens=3), make_request("b", prompt, max_tokens=3)
    s.add_request(a)
    s.add_request(b)
    out = step(s, runner)
    assert out.num_scheduled_tokens == {"a": 17, "b": 17}
    kv = s.kv_cache_manager
    a_blocks, b_blocks = kv.get_block_ids("a"), kv.get_block_ids("b")
    assert set(a_blocks).isdisjoint(b_blocks)
    c = make_request("c", prompt, max_tokens=3)
    s.add_request(c)
    out = step(s, runner)
    assert out.num_scheduled_tokens["c"] == 1 and kv.get_block_ids("c")[:4] == a_blocks[:4]
    run_until_done(s, runner)
    assert a.output_token_ids == b.output_token_ids == c.output_token_ids == reference_stream(prompt, 3)


@pytest.mark.parametrize("state", ["waiting", "running", "mid_prefill", "preempted", "finished", "unknown"])
def test_abort_in_every_state_frees_everything(make_scheduler, state):
    s = make_scheduler(num_blocks=4, max_num_batched_tokens=8, max_num_seqs=2)
    runner = PagedFakeRunner(s.block_size)
    target = make_request("t", 6, max_tokens=8)
    other = make_request("o", 6, max_tokens=8)
    if state == "waiting":
        s.add_request(other)
        s.add_request(make_request("x", 6, max_tokens=8))
        s.add_request(target)
        step(s, runner)
        assert target.status == RequestStatus.WAITING
    elif state == "running":
        s.add_request(target)
        step(s, runner)
        step(s, runner)
        assert target.status == RequestStatus.RUNNING and target.num_output_tokens == 2
    elif state == "mid_prefill":
        s.add_request(make_request("t", 14, max_tokens=2))
        step(s, runner)
        target = s.requests["t"]
        assert 0 < target.num_computed_tokens < target.num_prompt_tokens
    elif state == "preempted":
        s.add_request(other)
        s.add_request(target)
        while target.status != RequestStatus.PREEMPTED:
            step(s, runner)
    elif state == "finished":
        target = make_request("t", 6, max_tokens=1)
        s.add_request(target)
        step(s, runner)
        assert target.status == RequestStatus.FINISHED_LENGTH
    if state in ("finished", "unknown"):
        # An abort that comes too late (or names nobody) changes nothing: not the finished
        # request's status, and not the request that still runs.
        s.add_request(other)
        step(s, runner)
        other_blocks = s.kv_cache_manager.get_block_ids("o")
    s.abort_requests(["t"], now=5.0)
    if state not in ("finished", "unknown"):
        assert target.status == RequestStatus.FINISHED_ABORTED and target.finish_reason == "abort"
        assert target.finished_time == 5.0
        assert "t" not in s.requests and "t" not in s.kv_cache_manager.req_to_blocks
        out = step(s, runner)
        assert "t" in out.finished_req_ids
    else:
        if state == "finished":
            assert target.status == RequestStatus.FINISHED_LENGTH and target.finished_time == 0.0
        assert s.running == [other] and s.kv_cache_manager.get_block_ids("o") == other_blocks
        out = step(s, runner)
        assert "t" not in out.finished_req_ids and out.num_scheduled_tokens == {"o": 1}
    run_until_done(s, runner)


def test_abort_between_schedule_and_update(make_scheduler):
    s = make_scheduler()
    runner = PagedFakeRunner(s.block_size)
    s.add_request(make_request("a", 5))
    out = s.schedule()
    sampled = runner.execute(out)
    s.abort_requests(["a"])
    assert s.update_from_output(out, sampled) == []


def test_prompt_that_can_never_fit_is_ignored_without_blocking(make_scheduler):
    s = make_scheduler(num_blocks=4, max_model_len=100)  # the pool holds 16 tokens
    runner = PagedFakeRunner(s.block_size)
    big = make_request("big", 17)
    small = make_request("small", 3, max_tokens=2)
    s.add_request(big)
    s.add_request(small)
    assert big.status == RequestStatus.FINISHED_IGNORED and big.finish_reason == "length"
    assert "17 tokens" in big.status_message and "KV pool 4 blocks" in big.status_message
    run_until_done(s, runner)
    assert small.num_output_tokens == 2
    too_long = make_request("long", 101)
    s2 = make_scheduler(max_model_len=100, num_blocks=100)
    s2.add_request(too_long)
    assert too_long.status == RequestStatus.FINISHED_IGNORED and "max_model_len 100" in too_long.status_message


def test_duplicate_request_id_is_refused(make_scheduler):
    s = make_scheduler()
    s.add_request(make_request("a", 3))
    with pytest.raises(ValueError, match="'a' is already in use"):
        s.add_request(make_request("a", 3))
    s.abort_requests(["a"])


def test_reset_prefix_cache_drops_hits(make_scheduler):
    s = make_scheduler()
    runner = PagedFakeRunner(s.block_size)
    prompt = list(range(40, 53))
    s.add_request(make_request("a", prompt, max_tokens=1))
    run_until_done(s, runner)
    s.reset_prefix_cache()
    b = make_request("b", prompt, max_tokens=1)
    s.add_request(b)
    run_until_done(s, runner)
    assert b.num_cached_tokens == 0
    assert s.get_stats().prefix_cache.resets == 1


def test_stats_and_timestamps(make_scheduler):
    s = make_scheduler(max_num_seqs=1)
    runner = PagedFakeRunner(s.block_size)
    a = make_request("a", 5, max_tokens=2, arrival_time=0.5)
    s.add_request(a)
    s.add_request(make_request("b", 5, max_tokens=2))
    step(s, runner, now=1.0)
    stats = s.get_stats()
    assert (stats.num_running, stats.num_waiting, stats.num_swapped) == (1, 1, 0)
    assert stats.kv_cache_usage == 2 / 64
    step(s, runner, now=2.0)
    assert (a.first_scheduled_time, a.first_token_time, a.last_token_time, a.finished_time) == (1.0, 1.0, 2.0, 2.0)
    run_until_done(s, runner)


def test_equal_priority_requests_do_not_preempt_each_other_forever(make_scheduler):
    """Found by the property test: two equal-priority prompts that only fit one at a time,
    prefilled in threshold-sized pieces. With ties between them left to list order, each in turn
    was the victim and neither ever finished; ties now fall to the request id."""
    s = make_scheduler(max_num_batched_tokens=24, max_num_seqs=2, block_size=1, num_blocks=21,
                       policy="priority", long_prefill_token_threshold=3,
                       enable_prefix_caching=False, max_model_len=24)
    runner = PagedFakeRunner(s.block_size)
    r0, r1 = (make_request(rid, list(range(10, 30)) + [100], max_tokens=1, ignore_eos=True) for rid in ("r0", "r1"))
    s.add_request(r0)
    s.add_request(r1)
    run_until_done(s, runner, max_steps=100)
    assert r1.num_preemptions >= 1 and r0.num_preemptions == 0  # always the same victim


def test_one_id_aborts_that_request_not_the_ones_named_by_its_characters(make_scheduler):
    s = make_scheduler()
    for rid in ("a", "b", "ab"):
        s.add_request(make_request(rid, 4))
    s.abort_requests("ab")  # one id, as vLLM's scheduler takes it
    assert set(s.requests) == {"a", "b"}
    s.abort_requests(["a", "b"])
    assert not s.requests


def test_the_scheduler_refuses_a_status_time_or_request_it_cannot_act_on(make_scheduler):
    s = make_scheduler()
    runner = PagedFakeRunner(s.block_size)
    s.add_request(make_request("r", 4, max_tokens=3))
    with pytest.raises(ValueError, match="finish_requests needs a finished status, got <RequestStatus.RUNNING"):
        s.finish_requests(["r"], RequestStatus.RUNNING)
    with pytest.raises(ValueError, match="now must be a finite number of seconds, got nan"):
        s.schedule(float("nan"))
    out = s.schedule(0.0)
    with pytest.raises(ValueError, match="now must be a finite number of seconds, got inf"):
        s.update_from_output(out, runner.execute(out), float("inf"))
    s.update_from_output(out, runner.execute(out), 0.1)  # the step was still in flight: nothing lost
    request = s.requests["r"]
    assert request.status == RequestStatus.RUNNING and request.num_output_tokens == 1
    s.abort_requests("r")
    # The aborted object carries its progress: adding it again would start from there.
    with pytest.raises(ValueError, match=r"request 'r' has been scheduled before \(FINISHED_ABORTED, 4 tokens"):
        s.add_request(request)
    s.add_request(make_request("r", 4, max_tokens=3))  # a new one with the same id is fine
    run_until_done(s, runner)

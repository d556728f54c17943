"""A step is a transaction: applied once (update_from_output) or failed (fail_step), matched to
the very requests it scheduled, and its failure touches nothing else."""

import pytest

from tests.core.helpers import (EOS, PagedFakeRunner, make_request, reference_stream, run_until_done,
                                step)
from tokenweir.core.scheduler import Scheduler
from tokenweir.request import RequestStatus


def test_a_request_re_added_under_an_aborted_id_is_not_credited_with_its_step(make_scheduler):
    s = make_scheduler(max_num_batched_tokens=64)
    runner = PagedFakeRunner(s.block_size)
    old = make_request("a", 10)
    s.add_request(old)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 10}
    sampled = runner.execute(out)
    s.abort_requests(["a"])
    new = make_request("a", [7, 8, 9, 10])
    s.add_request(new)
    assert s.update_from_output(out, sampled) == []
    assert new.num_computed_tokens == 0 and new.status == RequestStatus.WAITING
    assert new.output_token_ids == []
    run_until_done(s, runner)
    assert new.output_token_ids == reference_stream([7, 8, 9, 10], 4)


def test_an_exception_while_applying_a_step_leaves_no_finished_request_running(make_scheduler):
    s = make_scheduler()
    runner = PagedFakeRunner(s.block_size)
    done, other = make_request("done", 5, max_tokens=1), make_request("other", 5, max_tokens=3)
    s.add_request(done)
    s.add_request(other)
    out = s.schedule()
    sampled = runner.execute(out)
    del sampled["other"]  # a broken runner: "other" finished its prefill without a token
    with pytest.raises(RuntimeError, match="'other' finished its prefill but no token was sampled"):
        s.update_from_output(out, sampled)
    assert done.status == RequestStatus.FINISHED_LENGTH and done not in s.running
    # The step stays in flight until it is failed: nothing else may be scheduled meanwhile.
    with pytest.raises(RuntimeError, match=f"step {out.step_id} was neither applied"):
        s.schedule()
    assert s.fail_step(out) == [other]
    assert other.status == RequestStatus.FINISHED_ABORTED and s.running == []
    nxt = step(s, runner)
    assert nxt.finished_req_ids == {"done", "other"}  # the runner drops both


def test_a_failed_step_fails_only_the_requests_it_scheduled(make_scheduler):
    s = make_scheduler(max_num_seqs=1)
    runner = PagedFakeRunner(s.block_size)
    ran, waited = make_request("ran", 5, max_tokens=3), make_request("waited", 5, max_tokens=3)
    s.add_request(ran)
    s.add_request(waited)
    out = s.schedule()
    assert list(out.num_scheduled_tokens) == ["ran"]
    assert s.fail_step(out, now=3.0) == [ran]
    assert ran.status == RequestStatus.FINISHED_ABORTED and ran.finished_time == 3.0
    assert waited.status == RequestStatus.WAITING
    run_until_done(s, runner)
    assert waited.output_token_ids == reference_stream(waited.prompt_token_ids, 3)


def test_a_step_is_settled_exactly_once(make_scheduler):
    s = make_scheduler()
    runner = PagedFakeRunner(s.block_size)
    s.add_request(make_request("a", 5, max_tokens=2))
    out = s.schedule()
    s.update_from_output(out, runner.execute(out))
    with pytest.raises(ValueError, match=f"step {out.step_id} is not the step in flight"):
        s.update_from_output(out, {})
    with pytest.raises(ValueError, match="is not the step in flight"):
        s.fail_step(out)
    run_until_done(s, runner)


def test_the_budget_is_checked_for_real_not_by_an_assert(make_scheduler, monkeypatch):
    """An overspent step raises RuntimeError (an assert would vanish under python -O)."""
    s = make_scheduler(max_num_batched_tokens=8)
    monkeypatch.setattr(Scheduler, "_cap_tokens", lambda self, num_tokens, budget: num_tokens)
    s.add_request(make_request("a", 12))
    with pytest.raises(RuntimeError, match="step overspent its limits: 12 tokens for 1 requests"):
        s.schedule()
    s.abort_requests(["a"])


def test_eos_finishes_and_is_reported_once(make_scheduler):
    s = make_scheduler()
    runner = PagedFakeRunner(s.block_size, token_fn=lambda context: EOS)
    r = make_request("a", 5, max_tokens=8)
    s.add_request(r)
    step(s, runner)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.output_token_ids == [EOS]
    assert step(s, runner).finished_req_ids == {"a"}
    assert step(s, runner).finished_req_ids == set()

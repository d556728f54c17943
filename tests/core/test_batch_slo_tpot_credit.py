"""`slo` holding TPOT: a request sure of its length (ignore_eos, no stop ids or strings, a
max_tokens) banks a credit on its due times, which keep its last token due N - 1 periods after
its first (no torch)."""

from __future__ import annotations

import pytest

from tests.core.helpers import assert_no_leaks, make_request, reference_stream, virtual_steps
from tests.core.test_batch_slo import DEEP_MODEL
from tests.core.test_batch_slo_tpot import _controller, _decoding
from tokenweir.config import CacheConfig, SchedulerConfig
from tokenweir.core.batch_slo import SLOBatchConfig
from tokenweir.core.cost_model import StepComposition, chunk_composition, step_composition
from tokenweir.core.scheduler import Scheduler


@pytest.mark.parametrize("params, least", [
    (dict(ignore_eos=True), 20),                      # sure: runs to max_tokens
    (dict(ignore_eos=True, stop=["x"]), 0),           # a stop string may end it at any token
    (dict(ignore_eos=True, stop_token_ids=[7]), 0),   # so may a stop id
    (dict(ignore_eos=True, stop=["x"], min_tokens=5), 5),
    (dict(min_tokens=5), 5),                          # EOS may end it past min_tokens
    (dict(), 0),
])
def test_the_least_number_of_output_tokens(params, least):
    assert make_request("r", 8, max_tokens=20, **params).least_num_output_tokens == least


def test_the_least_number_of_output_tokens_is_cut_to_max_model_len():
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=30),
                  CacheConfig(block_size=4, num_blocks=64))
    r = make_request("r", 8, max_tokens=100, ignore_eos=True)
    assert r.least_num_output_tokens == 100
    s.add_request(r)
    assert r.least_num_output_tokens == 22  # 30 - 8: max_model_len ends it there


def _sure(tokens: int, last: float):
    r = _decoding("sure", first=1.0, last=last, tokens=tokens)
    r.sampling_params.ignore_eos = True
    r.max_num_tokens = r.num_prompt_tokens + 201  # N = 201 tokens: 200 ITLs
    return r


def test_a_request_sure_of_its_length_banks_the_credit_and_keeps_its_last_token_on_aim():
    c = _controller()  # target 100 ms, hysteresis 0.1: credit 0.025, due period 95 ms
    period, credit = 0.095, 0.025
    c.begin_step(1.0, [_decoding("unsure", first=1.0, last=1.0, tokens=1)])
    assert c.room == pytest.approx(period)  # no credit: its second token one period on
    c.begin_step(1.0, [_sure(1, last=1.0)])
    assert c.room == pytest.approx(period * (1 + credit * 200) / (1 + credit))  # 5.8 periods
    # The due times' slope is gentler, and the last token is due 200 periods after the first.
    for tokens in (100, 200):
        last = 1.0 + 0.01 * tokens  # ahead of its due time: the BEHIND_SHARE floor is earlier
        c.begin_step(last, [_sure(tokens, last)])
        due = 1.0 + period * (tokens + credit * 200) / (1 + credit)
        assert c.room == pytest.approx(due - last)
    assert due == pytest.approx(1.0 + 200 * period)


def _young_rows_and_long_prompts(sure: bool):
    # Long prompts, the first just after decode rows have had their first token: without the
    # credit each row is due one period on, and every step beside them is held to it. The later
    # ones keep the steps at the period until the rows finish (their TPOTs near the target).
    params = dict(ignore_eos=True) if sure else {}
    reqs = []
    for k in range(2):
        start = 60.0 * k  # each round drains before the next
        reqs += [(start + 0.001 * i, make_request(f"d{k}.{i}", 8 + i, max_tokens=200 + 3 * i, **params))
                 for i in range(4)]
        reqs += [(start + 0.05 + 3.0 * j, make_request(f"long{k}.{j}", 600 + 100 * j, max_tokens=4, **params))
                 for j in range(8)]
    return reqs


def _run(sure: bool):
    config = SLOBatchConfig(target_tpot_ms=150.0, interval=0.3, window=2.0, hold="tpot")
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=16, batch_controller="slo",
                                  batch_control_config=config),
                  CacheConfig(block_size=4, num_blocks=4000), cost_model=DEEP_MODEL)
    arrivals = _young_rows_and_long_prompts(sure)
    long_steps = 0
    for out, _, _ in virtual_steps(s, arrivals, lambda out: DEEP_MODEL.predict(step_composition(out, s.requests))):
        long_steps += any(rid.startswith("long") for rid in out.num_scheduled_tokens)
    tpots = {}
    for _, r in arrivals:
        assert r.output_token_ids == reference_stream(r.prompt_token_ids, r.num_output_tokens)
        tpots[r.request_id] = (r.last_token_time - r.first_token_time) / (r.num_output_tokens - 1)
    assert_no_leaks(s)
    return long_steps, tpots


def test_spending_the_credit_long_prompts_take_fewer_steps_and_every_tpot_stays_under_the_target():
    unsure_steps, unsure_tpots = _run(sure=False)
    sure_steps, sure_tpots = _run(sure=True)
    assert sure_steps < unsure_steps  # the young rows' credit lets the long prompts through
    assert max(sure_tpots.values()) <= 0.150 * (1 - 0.1 / 4)  # under the band's top, as without it
    assert max(unsure_tpots.values()) <= 0.150 * (1 - 0.1 / 4)


def test_a_request_id_used_again_gets_the_due_times_of_its_new_request():
    c = _controller()
    period, credit = 0.095, 0.025
    c.begin_step(1.0, [_sure(1, last=1.0)])
    assert c.room == pytest.approx(period * (1 + credit * 200) / (1 + credit))
    # The same id, a new request that may stop at any token (the first one has finished): its
    # due times are its own (a cache of them by request id must not carry the old ones over).
    again = _decoding("sure", first=1.0, last=1.0, tokens=1)
    c.begin_step(1.0, [again])
    assert c.room == pytest.approx(period)


def test_a_request_preempted_by_recompute_before_the_first_cut_does_not_count():
    c = _controller(DEEP_MODEL)
    young = _decoding("young", first=1.0, last=1.0, tokens=1)  # due at 1.095 s
    old = _decoding("old", first=0.0, last=1.0, tokens=20)  # due at 1.9 s
    running = [young, old]
    c.begin_step(1.0, running)
    # Preempted by recompute in this step before any chunk (its context to compute again): it
    # gets no token from this step, so its due time does not count.
    running.remove(young)
    young.num_computed_tokens = 0
    n = c.cut_chunk(4096, 0, 4096, 4096, _rows(1), 0)
    assert c.room == pytest.approx(0.9)
    assert DEEP_MODEL.predict(_rows(1) + chunk_composition(n, 0, 4096, 4096)) <= 0.9
    young.num_computed_tokens = len(young.all_token_ids) - 1  # the room stays that of the first cut
    assert c.room == pytest.approx(0.9)


def test_a_request_swapped_out_in_the_step_still_counts():
    # The room is of the requests that ran at the step's start: one swapped out later in the
    # step keeps its state (decoding), and counts as before the room was found lazily.
    c = _controller(DEEP_MODEL)
    young = _decoding("young", first=1.0, last=1.0, tokens=1)  # due at 1.095 s
    running = [young, _decoding("old", first=0.0, last=1.0, tokens=20)]
    c.begin_step(1.0, running)
    running.remove(young)
    assert c.room == pytest.approx(0.095)


def _rows(n: int) -> StepComposition:
    return StepComposition(num_decode_seqs=n, decode_context_tokens=100 * n, num_sampled=n)

"""`slo` holding TPOT (`--batch-control-hold tpot`): each decoding request's next token is due by
its first token's time plus the due period per token it has; a step may last until the
earliest due token, and the period moves on the p99 TPOT of finished requests (no torch)."""

from __future__ import annotations

import pytest

from tests.core.helpers import assert_no_leaks, make_request, reference_stream, virtual_steps
from tests.core.test_batch_slo import DEEP_MODEL, MODEL
from tokenweir.config import CacheConfig, EngineArgs, SchedulerConfig
from tokenweir.core.batch_control import StepObservation
from tokenweir.core.batch_slo import BEHIND_SHARE, MIN_CHUNK_TOKENS, MIN_TPOTS, SLOBatchConfig, SLOBatchController
from tokenweir.core.batch_control import StepLimits
from tokenweir.core.cost_model import StepComposition, chunk_composition, step_composition
from tokenweir.core.scheduler import Scheduler


def _controller(model=MODEL, **kwargs) -> SLOBatchController:
    config = SLOBatchConfig(target_tpot_ms=100.0, hold="tpot", **kwargs)
    return SLOBatchController(config, StepLimits(4096, 64), model)


def _decoding(rid: str, first: float, last: float, tokens: int):
    r = make_request(rid, 8, max_tokens=1000)
    r.output_token_ids.extend([1] * tokens)
    r.all_token_ids.extend([1] * tokens)
    r.num_computed_tokens = len(r.all_token_ids) - 1  # a decoding row: its last token to compute
    r.first_token_time, r.last_token_time = first, last
    return r


@pytest.mark.parametrize("kwargs, message", [
    (dict(batch_controller="slo", target_tpot_ms=100, batch_control_hold="ttft"),
     "batch control hold must be one of itl, tpot, got 'ttft'"),
    (dict(batch_control_hold="tpot"), "batch_control_hold only applies to batch_controller 'slo', not 'static'"),
])
def test_a_bad_hold_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs).create_engine_configs(4096, 100)


def test_the_step_may_last_until_the_earliest_due_token():
    c = _controller()
    assert c.bias == pytest.approx(0.95)  # inside the band from the start: due every 95 ms
    old = _decoding("old", first=0.0, last=0.5, tokens=10)  # due at 0.95 s: 0.45 s of slack
    young = _decoding("young", first=0.4, last=0.4, tokens=1)  # its first ITL: due at 0.495 s
    prefilling = make_request("p", 500)  # no token yet: nothing is due
    c.begin_step(0.45, [old, prefilling, young])
    assert c.room == pytest.approx(0.045)
    c.begin_step(0.45, [old, prefilling])
    assert c.room == pytest.approx(0.5)
    # A request behind its due time (first + 10 x 95 ms = 0.95 s, its last token at 1.2 s)
    # still gets BEHIND_SHARE of a period: it catches up, it does not stop every step.
    behind = _decoding("behind", first=0.0, last=1.2, tokens=10)
    c.begin_step(1.21, [behind])
    assert c.room == pytest.approx(1.2 + BEHIND_SHARE * 0.095 - 1.21)
    # No decoding request: no row waits for the step, the chunk is not cut at all.
    c.begin_step(1.3, [prefilling])
    assert c.cut_chunk(4000, 0, 4000, 4000, StepComposition(), 0) == 4000


def test_a_chunk_is_cut_to_the_room_the_due_tokens_leave():
    c = _controller(DEEP_MODEL)
    rows = StepComposition(num_decode_seqs=4, decode_context_tokens=800, num_sampled=4)  # 36 ms
    for room in (0.1, 0.4):  # the young row's due period, and 0.4 s of slack on every row
        c._room = room
        n = c.cut_chunk(2048, 0, 2048, 2048, rows, 0)
        assert DEEP_MODEL.predict(rows + chunk_composition(n, 0, 2048, 2048)) <= room < DEEP_MODEL.predict(
            rows + chunk_composition(n + 1, 0, 2048, 2048))
    c._room = 0.01  # nothing fits: the step's first chunk gets the floor, a second one waits
    assert c.cut_chunk(512, 0, 2048, 2048, rows, 0) == MIN_CHUNK_TOKENS
    assert c.cut_chunk(512, 0, 2048, 2048, rows + chunk_composition(16, 0, 2048, 2048), 0) == 0


def _observe(now, tpots, waiting=5):
    comp = StepComposition(num_decode_seqs=8, decode_context_tokens=800, num_sampled=8)
    return StepObservation(now, comp, 8, (), 8, waiting, 800, 0.1, tpots)


def test_the_due_period_moves_on_the_p99_tpot_of_requests_finished_since_it_moved():
    c = _controller()
    c.get_limits(0.0)
    # Finished requests over the band's top (97.5 ms): the period shrinks in proportion.
    c.on_step(_observe(0.5, [0.120] * MIN_TPOTS))
    c.get_limits(1.0)
    assert c.p99_tpot == pytest.approx(0.120)
    assert c.bias == pytest.approx(0.95 * 0.0975 / 0.120)
    shrunk = c.bias
    # The same requests do not shrink it twice: only those finished since the move count, and
    # fewer than MIN_TPOTS decide nothing.
    c.on_step(_observe(1.5, [0.120] * (MIN_TPOTS - 1)))
    c.get_limits(2.0)
    assert c.p99_tpot is None and c.bias == shrunk
    # Well under the band, with a limit holding work back, it grows once a window has passed
    # since the move (by at most GROWTH), and never past the band's top.
    for t in range(3, 40):
        c.on_step(_observe(t - 0.5, [0.050] * MIN_TPOTS))
        c._held_back = True
        c.get_limits(float(t))
    assert shrunk < c.bias <= 0.975


def _arrivals():
    # Requests decode beside long prompts arriving now and then: under `itl` every step beside
    # the decode rows is held to the target; under `tpot` the rows' slack lets prompts through.
    reqs = [(0.05 * i, make_request(f"d{i}", 8 + i, max_tokens=60 + 7 * i)) for i in range(6)]
    reqs += [(1.0 + 1.5 * i, make_request(f"long{i}", 900 + 50 * i, max_tokens=5 + 3 * i)) for i in range(4)]
    return reqs


def _run(hold):
    config = SLOBatchConfig(target_tpot_ms=150.0, interval=0.3, window=2.0, hold=hold)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=16, batch_controller="slo",
                                  batch_control_config=config),
                  CacheConfig(block_size=4, num_blocks=2000), cost_model=DEEP_MODEL)
    arrivals = _arrivals()
    periods, long_steps = [], 0
    for out, now, _ in virtual_steps(s, arrivals, lambda out: DEEP_MODEL.predict(step_composition(out, s.requests))):
        comp = step_composition(out, s.requests)
        if comp.num_decode_seqs:
            periods.append(DEEP_MODEL.predict(comp))
        long_steps += any(rid.startswith("long") for rid in out.num_scheduled_tokens)
    tpots = {}
    for _, r in arrivals:
        assert r.output_token_ids == reference_stream(r.prompt_token_ids, r.num_output_tokens)
        if r.num_output_tokens > 1:
            tpots[r.request_id] = (r.last_token_time - r.first_token_time) / (r.num_output_tokens - 1)
    assert_no_leaks(s)
    return periods, long_steps, tpots


def test_holding_tpot_every_request_meets_it_while_steps_outlast_it_and_prompts_take_fewer_steps():
    itl_periods, itl_long_steps, itl_tpots = _run("itl")
    periods, long_steps, tpots = _run("tpot")
    assert max(itl_periods) <= 0.15 + 1e-9  # `itl` holds every step beside decode rows
    assert max(periods) > 0.15  # `tpot` lets a step outlast the target where the rows have slack...
    assert max(tpots.values()) <= 0.15  # ...and every request's TPOT stays under it
    assert long_steps < itl_long_steps  # the long prompts go through in fewer steps


def test_a_request_swapped_in_during_the_step_does_not_cut_its_chunks_to_the_floor():
    # "s" is swapped out and back in; in the step it comes back its first and last tokens
    # predate the swap-out, so its due time is long past: counted, it would make the room
    # negative and cut the waiting prompt's chunk to MIN_CHUNK_TOKENS.
    config = SLOBatchConfig(target_tpot_ms=100.0, hold="tpot", initial_num_batched_tokens=64, initial_num_seqs=4,
                            interval=1000.0, window=1000.0)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, batch_controller="slo",
                                  batch_control_config=config),
                  CacheConfig(block_size=4, num_blocks=16, enable_prefix_caching=False, preemption_mode="swap",
                              num_host_blocks=32), cost_model=MODEL)
    c = s.batch_controller
    arrivals = [(0.0, make_request("d", 20, max_tokens=16, ignore_eos=True)),
                (0.001, make_request("s", 20, max_tokens=30, ignore_eos=True, arrival_time=0.001)),
                (0.5, make_request("p", 24, max_tokens=2, ignore_eos=True, arrival_time=0.5))]
    swapped_in = rooms = 0
    for out, _, _ in virtual_steps(s, arrivals, lambda out: 0.09):
        swapped_in += bool(out.blocks_to_swap_in)
        if c._room is not None and c._room != float("inf"):
            rooms += 1
            assert c._room > 0
    assert swapped_in and rooms  # the case happened, and rooms were found
    assert_no_leaks(s)

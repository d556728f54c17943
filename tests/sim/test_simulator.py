"""The simulator drives the real scheduler in virtual time: hand-computed latencies, conservation,
no leaks, determinism, client limits and aborts."""

from __future__ import annotations

import numpy as np
import pytest

from tests.core.helpers import assert_no_leaks
from tests.sim.helpers import cost_model
from tokenweir.config import EngineArgs
from tokenweir.sim.simulator import SimRequest, Simulator


def make_sim(model=None, **engine_kwargs) -> Simulator:
    return Simulator.from_engine_args(EngineArgs(**engine_kwargs), model or cost_model(step=0.1))


def req(rid: str, prompt_len: int, output_len: int, at: float, **kw) -> SimRequest:
    base = 1000 * (1 + sum(map(ord, rid)))  # distinct ids per request: no prefix hits
    return SimRequest(rid, list(range(base, base + prompt_len)), output_len, at, **kw)


def test_hand_computed_latencies_with_a_constant_step_time() -> None:
    # Every step takes 0.1 s. A (t=0, 8-token prompt, 3 tokens): steps end at 0.1, 0.2, 0.3.
    # B arrives at 0.15, during A's second step, so the engine first sees it at 0.2; its prompt
    # runs in the step ending 0.3 (TTFT 0.15) and its second token in the one ending 0.4.
    sim = make_sim()
    result = sim.run([req("a", 8, 3, 0.0), req("b", 4, 2, 0.15)])
    a, b = result.records
    assert (a.ttft, a.latency, a.output_tokens) == pytest.approx((0.1, 0.3, 3))
    assert a.itl == pytest.approx([0.1, 0.1]) and a.tpot == pytest.approx(0.1)
    assert (b.ttft, b.latency, b.output_tokens) == pytest.approx((0.15, 0.25, 2))
    assert b.tpot == pytest.approx(0.1)
    assert result.num_steps == 4 and result.duration_s == pytest.approx(0.4)
    assert_no_leaks(sim.scheduler)


def test_step_time_follows_the_cost_model_of_each_steps_composition() -> None:
    # 1 ms per token: the 100-token prompt's step takes 0.1 s, each decode step 1 ms.
    sim = make_sim(cost_model(tokens=0.001))
    (r,) = sim.run([req("a", 100, 5, 0.0)]).records
    assert r.ttft == pytest.approx(0.1) and r.itl == pytest.approx([0.001] * 4)


def test_idle_engine_waits_for_the_next_arrival() -> None:
    sim = make_sim()
    result = sim.run([req("a", 4, 1, 0.0), req("b", 4, 1, 5.0)])
    assert [r.ttft for r in result.records] == pytest.approx([0.1, 0.1])
    assert result.duration_s == pytest.approx(5.1)


def test_conservation_and_no_leaks_under_preemption() -> None:
    # A pool of 20 blocks of 16 tokens for 60 requests of up to 200 tokens: preemptions happen.
    rng = np.random.default_rng(0)
    requests = [req(f"r{i}", int(rng.integers(10, 120)), int(rng.integers(1, 80)), float(i) * 0.01)
                for i in range(60)]
    sim = make_sim(cost_model(step=0.01, tokens=0.0001), num_gpu_blocks_override=20,
                   max_num_batched_tokens=64, max_num_seqs=16)
    result = sim.run(requests)
    assert result.num_preemptions > 0
    for r, record in zip(requests, result.records):
        assert record.success and record.output_tokens == r.output_len
        assert record.prompt_len == len(r.prompt_token_ids)
    assert_no_leaks(sim.scheduler)
    series = result.timeseries.to_dict()
    assert sum(series["num_steps"]) == result.num_steps
    assert sum(series["num_preemptions"]) == result.num_preemptions
    assert max(series["kv_cache_usage"]) <= 1.0


def test_same_inputs_same_result() -> None:
    def run():
        rng = np.random.default_rng(7)
        requests = [req(f"r{i}", int(rng.integers(1, 300)), int(rng.integers(1, 50)),
                        float(rng.uniform(0, 3))) for i in range(100)]
        sim = make_sim(cost_model(step=0.005, tokens=0.0002, decode_context=1e-6),
                       num_gpu_blocks_override=40, max_num_batched_tokens=128)
        result = sim.run(requests)
        return [(r.ttft, r.latency, tuple(r.itl)) for r in result.records], result.timeseries.to_dict()

    assert run() == run()


def test_client_concurrency_limit_sends_one_request_at_a_time() -> None:
    # Three requests at t=0, one client slot: each is sent when the previous one ends, and its
    # latency counts from then.
    sim = make_sim()
    result = sim.run([req(f"r{i}", 4, 2, 0.0) for i in range(3)], max_concurrency=1)
    assert [r.ttft for r in result.records] == pytest.approx([0.1] * 3)
    assert [r.latency for r in result.records] == pytest.approx([0.2] * 3)
    assert result.duration_s == pytest.approx(0.6)


def test_client_abort_fails_the_request_and_frees_its_blocks() -> None:
    sim = make_sim()
    result = sim.run([req("slow", 4, 100, 0.0, abort_after_s=0.55), req("ok", 4, 3, 0.0)])
    slow, ok = result.records
    assert not slow.success and slow.error == "finished_aborted" and slow.output_tokens == 5
    assert ok.success and ok.output_tokens == 3
    assert_no_leaks(sim.scheduler)


def test_a_prompt_that_can_never_fit_fails_alone() -> None:
    sim = make_sim(max_model_len=64)
    result = sim.run([req("long", 100, 2, 0.0), req("ok", 4, 2, 0.0)])
    long, ok = result.records
    assert not long.success and "maximum context length is 64 tokens, and `prompt` has 100" in long.error
    assert ok.success
    assert_no_leaks(sim.scheduler)


def test_what_the_server_refuses_for_its_length_fails_rather_than_being_cut_short() -> None:
    # The server answers 400 to a prompt that leaves no room for output and to prompt + max_tokens
    # over max_model_len (vLLM's rule); the scheduler alone would cap the output at the context.
    sim = make_sim(max_model_len=64)
    records = sim.run([req("over", 40, 30, 0.0), req("full", 64, 1, 0.0), req("exact", 40, 24, 0.0)]).records
    over, full, exact = records
    assert not over.success and over.output_tokens == 0
    assert over.error.startswith("This model's maximum context length is 64 tokens. However, you requested 70")
    assert not full.success and "leaves no room for output" in full.error
    assert exact.success and exact.output_tokens == 24
    assert_no_leaks(sim.scheduler)


def test_a_client_that_gives_up_during_the_last_step_gets_a_failure() -> None:
    # Steps of 0.1 s. "one" gives up at 0.05, inside the step that computes its only token;
    # "three" at 0.25, inside the step of its last token: the engine finishes both by length,
    # but neither client heard its last token.
    sim = make_sim()
    one, three, ok = sim.run([req("one", 8, 1, 0.0, abort_after_s=0.05),
                              req("three", 8, 3, 0.0, abort_after_s=0.25), req("ok", 8, 3, 0.0)]).records
    assert not one.success and one.output_tokens == 0 and one.error == "aborted by the client before its last token"
    assert not three.success and three.output_tokens == 2
    assert ok.success and ok.output_tokens == 3
    assert_no_leaks(sim.scheduler)


def test_the_simulated_decisions_are_the_policys(monkeypatch) -> None:
    # Priority policy: a later, more important request is served first once it arrives.
    sim = make_sim(scheduling_policy="priority", max_num_seqs=1, max_num_batched_tokens=16)
    from tokenweir.request import SchedulingHints

    result = sim.run([req("first", 4, 1, 0.0), req("low", 4, 1, 0.01, hints=SchedulingHints(priority=5)),
                      req("high", 4, 1, 0.02, hints=SchedulingHints(priority=-5))])
    first, low, high = result.records
    assert high.latency + 0.02 < low.latency + 0.01  # high finished before low


def test_bad_arguments() -> None:
    sim = make_sim()
    with pytest.raises(ValueError, match="unique"):
        sim.run([req("a", 4, 1, 0.0), req("a", 4, 1, 0.0)])
    with pytest.raises(ValueError, match="max_concurrency"):
        make_sim().run([req("a", 4, 1, 0.0)], max_concurrency=0)
    # Times and lengths a replay could not honour: each names its request and field.
    for kw, match in ((dict(output_len=0), r"^request 'a': output_len must be an integer >= 1, got 0$"),
                      (dict(output_len=2.0), "output_len must be an integer"),
                      (dict(arrival_s=-1.0), r"^request 'a': arrival_s must be a finite number >= 0, got -1.0$"),
                      (dict(arrival_s=float("nan")), "arrival_s must be a finite number"),
                      (dict(abort_after_s=0.0), r"^request 'a': abort_after_s must be a finite number > 0 or None"),
                      (dict(abort_after_s=float("nan")), "abort_after_s must be a finite number")):
        with pytest.raises(ValueError, match=match):
            SimRequest(**{"request_id": "a", "prompt_token_ids": [1, 2], "output_len": 1, "arrival_s": 0.0, **kw})
    for key, value in (("kv_cache_bytes", None), ("block_size", 0), ("kv_bytes_per_block", "x")):
        model = cost_model(step=0.1)
        if value is None:
            model.metadata.pop(key)
        else:
            model.metadata[key] = value
        with pytest.raises(ValueError, match="lacks the model's max_model_len"):
            Simulator.from_engine_args(EngineArgs(), model)


def test_a_request_arriving_while_every_client_slot_is_busy_waits_for_the_slot() -> None:
    # One slot, steps of 1 s: b arrives at 0.5 while a holds the slot until 1.0, so bench serve
    # would send b at 1.0; its TTFT counts from then (1 s), not from its arrival (1.5 s).
    sim = make_sim(cost_model(step=1.0))
    a, b = sim.run([req("a", 4, 1, 0.0), req("b", 4, 1, 0.5)], max_concurrency=1).records
    assert a.ttft == pytest.approx(1.0) and b.ttft == pytest.approx(1.0)


def test_duration_runs_from_time_zero_to_the_last_request_to_end() -> None:
    # As bench serve measures it: from its start, not from the first arrival, and a request
    # that fails last still ends the benchmark.
    sim = make_sim(cost_model(step=1.0), max_model_len=64)
    result = sim.run([req("a", 4, 1, 2.0), req("rejected", 100, 1, 5.0)])
    assert result.duration_s == pytest.approx(5.0)
    assert [r.success for r in result.records] == [True, False]


def test_many_requests_rejected_behind_a_client_limit_do_not_recurse() -> None:
    sim = make_sim(max_model_len=64)
    requests = [req(f"r{i}", 100, 1, 0.0) for i in range(3000)] + [req("ok", 4, 2, 0.0)]
    result = sim.run(requests, max_concurrency=1)
    assert sum(r.success for r in result.records) == 1
    assert_no_leaks(sim.scheduler)


def test_requests_a_policy_sheds_end_with_its_reason() -> None:
    from tokenweir.request import SchedulingHints

    # sla with drop_expired: requests whose deadline passes while they wait are finished by the
    # scheduler inside schedule(); the simulator must count them as done, failed, with the reason.
    sim = make_sim(cost_model(step=0.5), scheduling_policy="sla", sla_drop_expired=True,
                   max_num_seqs=1, max_num_batched_tokens=16)
    requests = [req(f"r{i}", 4, 4, 0.0, hints=SchedulingHints(deadline=1.0)) for i in range(4)]
    result = sim.run(requests, max_concurrency=2)
    shed = [r for r in result.records if not r.success]
    assert shed and all("deadline" in r.error for r in shed)
    assert_no_leaks(sim.scheduler)


def test_requests_that_cannot_meet_their_deadline_are_shed_at_once(tmp_path) -> None:
    from tests.sim.helpers import write_profile
    from tokenweir.request import SchedulingHints

    # Steps of 0.5 s: 4 outputs alone take 2 s, x 0.8 = 1.6 s. With drop_expired only, the first
    # request holds the engine's one slot for 1 s of steps before its deadline passes, and the
    # second one (deadline 2.6 s) then ends at 3 s, late; with drop_unmeetable the first is shed
    # at 0 and the second one finishes at 2 s. The profile is the simulated machine's, as is.
    model = cost_model(step=0.5)
    profile = str(write_profile(tmp_path / "p.json", model))
    requests = [req("hopeless", 4, 4, 0.0, hints=SchedulingHints(deadline=1.0)),
                req("feasible", 4, 4, 0.0, hints=SchedulingHints(deadline=2.6))]
    common = dict(scheduling_policy="sla", max_num_seqs=1, max_num_batched_tokens=16, sla_cost_profile=profile)
    expired_only = make_sim(model, sla_drop_expired=True, **common).run(requests)
    late = expired_only.records[1]
    assert not expired_only.records[0].success and late.success and late.latency == pytest.approx(3.0)
    sim = make_sim(model, sla_drop_unmeetable=True, sla_step_time_correction=False, **common)
    hopeless, feasible = sim.run(requests).records
    assert hopeless.error.startswith("deadline cannot be met: needs at least 1600.0 ms, 1000.0 ms left") and hopeless.output_tokens == 0
    assert feasible.success and feasible.latency == pytest.approx(2.0)
    assert sim.scheduler.policy.get_stats()["deadline_shed"] == {"expired": 0, "unmeetable": 1}
    assert_no_leaks(sim.scheduler)

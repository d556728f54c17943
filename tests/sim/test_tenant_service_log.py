"""The step observer of benchmarks/sla_sim.py's "backlogged" part: it counts each tenant's
service as VTC does and leaves the simulated run as it was."""

import importlib.util
import sys
from pathlib import Path

import pytest

from tokenweir.config import EngineArgs
from tokenweir.core.cost_model import load_cost_model
from tokenweir.request import SchedulingHints
from tokenweir.sim.simulator import SimRequest, Simulator

_SPEC = importlib.util.spec_from_file_location(
    "sla_sim", Path(__file__).resolve().parents[2] / "benchmarks" / "sla_sim.py")
sla_sim = importlib.util.module_from_spec(_SPEC)
sys.modules["sla_sim"] = sla_sim  # its dataclasses look their module up
_SPEC.loader.exec_module(sla_sim)


def _requests() -> list[SimRequest]:
    # Heavy sends 10 for each of light's, all at once: both backlogged from the start. Prompts
    # share no prefix (a prefix-cache hit is not charged).
    return [SimRequest(f"r{i}", list(range(100 * i, 100 * i + 40 + 13 * (i % 5))), 3 + i % 4, 0.01 * i,
                       SchedulingHints(tenant="light" if i % 11 == 0 else "heavy")) for i in range(88)]


def _run(policy: str, observe: bool):
    args = EngineArgs(scheduling_policy=policy, max_num_seqs=4, max_num_batched_tokens=64)
    sim = Simulator.from_engine_args(args, load_cost_model(None), timeseries_points=1)
    log = sla_sim.TenantServiceLog(sim.scheduler)
    if observe:
        sim.on_step = log
    return sim.run(_requests()), log


@pytest.mark.parametrize("policy", ["fcfs", "vtc"])
def test_the_log_counts_vtc_service_and_changes_no_decision(policy):
    observed, log = _run(policy, observe=True)
    plain, _ = _run(policy, observe=False)
    assert [(r.ttft, r.latency) for r in observed.records] == [(r.ttft, r.latency) for r in plain.records]
    assert observed.num_preemptions == 0  # else recomputed tokens would (rightly) go uncounted
    # Every prompt token once at input_weight 1, every output token at output_weight 2.
    for tenant in ("heavy", "light"):
        mine = [r for r in _requests() if r.hints.tenant == tenant]
        assert sum(s.service.get(tenant, 0.0) for s in log.steps) == sum(len(r.prompt_token_ids) + 2 * r.output_len
                                                                          for r in mine)
        assert sum(s.output_tokens.get(tenant, 0) for s in log.steps) == sum(r.output_len for r in mine)
    window = log.both_backlogged("heavy", "light")
    assert window["steps"] > 0
    if policy == "vtc":
        assert 0.4 < window["service_share"]["light"] < 0.6
        assert window["max_counter_gap"] <= 2 * log.step_bound()
    else:
        assert window["service_share"]["light"] < 0.2 and window["max_counter_gap"] is None


def test_the_client_view_counts_what_arrives_while_both_tenants_wait_for_a_first_token():
    from tokenweir.bench.serve_metrics import RequestRecord

    def rec(prompt: int, ttft: float, itl: list[float]) -> RequestRecord:
        return RequestRecord(success=True, prompt_len=prompt, output_tokens=len(itl) + 1, ttft=ttft, itl=itl)

    # Heavy waits for a first token over [0, 10), light over [2, 6): both backlogged in [2, 6).
    arrivals = [0.0, 2.0, 3.0, 4.0, 1.0]
    tenants = ["heavy", "light", "heavy", "light", None]
    records = [rec(100, 10.0, []),  # its prompt and token come at 10: outside
               rec(50, 4.0, [1.0]),  # at 6 (the window is half-open) and 7: outside
               rec(10, 1.0, [1.0, 5.0]),  # prompt and tokens at 4 and 5 inside, 10 outside
               rec(6, 0.5, [0.5, 3.0]),  # prompt and tokens at 4.5 and 5 inside, 8 outside
               rec(999, 2.5, [])]  # no tenant of the two: not counted
    view = sla_sim.client_view(arrivals, tenants, records)
    assert view["seconds"] == pytest.approx(4.0) and view["last_s"] == pytest.approx(6.0)
    assert view["service_share"]["light"] == pytest.approx((6 + 2 * 2) / (6 + 2 * 2 + 10 + 2 * 2))
    assert view["output_share"] == {"heavy": 0.5, "light": 0.5}

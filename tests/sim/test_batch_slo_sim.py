"""The `slo` batch controller in the simulator, on a hand-written cost model: it converges to
the TPOT target under overload, at no less throughput than the static caps that meet it."""

from __future__ import annotations

import numpy as np

from tests.core.helpers import assert_no_leaks
from tests.sim.helpers import cost_model
from tokenweir.bench.serve_metrics import compute_metrics, metrics_to_dict
from tokenweir.config import EngineArgs
from tokenweir.sim.simulator import SimRequest, Simulator

# 20 ms per step, 1 ms per token, 20 us per K/V token read by a decode row.
MODEL = cost_model(step=0.02, tokens=0.001, decode_context=2e-5)
TARGET_MS = 120.0


def _requests(n=400, rate=6.0, seed=0):
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1 / rate, n))
    return [SimRequest(f"r{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + int(rng.integers(20, 200)))),
                       int(rng.integers(20, 120)), float(t)) for i, t in enumerate(arrivals)]


def _run(**engine):
    args = EngineArgs(**{"max_num_batched_tokens": 1024, "max_num_seqs": 128, "num_gpu_blocks_override": 4000,
                         **engine})
    sim = Simulator.from_engine_args(args, MODEL)
    result = sim.run(_requests())
    assert_no_leaks(sim.scheduler)
    assert result.num_preemptions == 0
    return metrics_to_dict(compute_metrics(result.records, result.duration_s, (99,)), ["tpot", "itl"])


def test_slo_meets_the_target_at_no_less_throughput_than_the_static_caps_that_do():
    slo = _run(batch_controller="slo", target_tpot_ms=TARGET_MS, batch_control_window=5.0)
    assert slo['p99_tpot_ms'] <= TARGET_MS
    meeting = []
    for seqs in (4, 8, 16, 32, 64):
        static = _run(max_num_seqs=seqs)
        if static['p99_tpot_ms'] <= TARGET_MS:
            meeting.append(static['request_throughput'])
    assert meeting, "no static cap meets the target: the workload does not test the controller"
    assert slo['request_throughput'] >= max(meeting)
    # The default (static, 128 seqs) overshoots the target on this load: the controller did work.
    default = _run()
    assert default['p99_tpot_ms'] > TARGET_MS

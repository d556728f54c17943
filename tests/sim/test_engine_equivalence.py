"""The simulated decisions are the engine's decisions.

The real `EngineCore` (tiny model) runs on a virtual clock that advances by the cost model's
prediction of each step, exactly as the simulator's clock does. Given the same arrivals, both
must schedule the same tokens for the same requests in every step, preempt the same requests,
and finish at the same times: nothing of the scheduler differs between them.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine.helpers import assert_engine_released
from tests.core.helpers import assert_no_leaks
from tests.sim.helpers import cost_model
from tokenweir.config import EngineArgs
from tokenweir.core.cost_model import step_composition
from tokenweir.engine.core import EngineCore
from tokenweir.request import SamplingParams, SchedulingHints
from tokenweir.sim.simulator import SimRequest, Simulator

BLOCK = 4


class VirtualClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def workload(seed: int, n: int = 24) -> list[SimRequest]:
    rng = np.random.default_rng(seed)
    shared = rng.integers(3, 200, size=12).tolist()  # some prompts share a prefix: cache hits
    out = []
    for i in range(n):
        own = rng.integers(3, 200, size=int(rng.integers(1, 30))).tolist()
        prompt = (shared + own) if rng.random() < 0.4 else own
        hints = SchedulingHints(priority=int(rng.integers(0, 3)))
        out.append(SimRequest(f"r{i}", prompt, int(rng.integers(1, 12)), float(rng.uniform(0, 0.5)), hints))
    return out


def run_engine(model_dir: str, args: EngineArgs, requests: list[SimRequest], model) -> list[tuple]:
    clock = VirtualClock()
    engine = EngineCore(args, clock=clock)
    per_block = model.metadata["kv_bytes_per_block"] // model.metadata["block_size"] * BLOCK
    pending = sorted(requests, key=lambda r: r.arrival_s)
    log = []
    while pending or engine.has_unfinished_requests():
        while pending and pending[0].arrival_s <= clock.t:
            r = pending.pop(0)
            engine.add_request(r.request_id, list(r.prompt_token_ids),
                               SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True),
                               SchedulingHints(priority=r.hints.priority, arrival_time=r.arrival_s))
        if not engine.has_unfinished_requests():
            clock.t = pending[0].arrival_s
            continue
        out = engine.schedule()
        log.append((round(clock.t, 9), sorted(out.num_scheduled_tokens.items()), sorted(out.preempted_req_ids)))
        clock.t += model.predict(step_composition(out, engine.scheduler.requests, per_block))
        result = engine.execute(out)
        assert not result.failed
    assert_engine_released(engine)
    return log


def run_sim(args: EngineArgs, requests: list[SimRequest], model) -> list[tuple]:
    log = []
    sim = Simulator.from_engine_args(args, model, on_step=lambda out, now: log.append(
        (round(now, 9), sorted(out.num_scheduled_tokens.items()), sorted(out.preempted_req_ids))))
    result = sim.run(requests)
    assert all(r.success for r in result.records)
    assert_no_leaks(sim.scheduler)
    return log


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", [0, 1])
def test_simulator_and_engine_schedule_identically(tiny_model_dir, policy, seed) -> None:
    model_dir = tiny_model_dir("llama")
    model = cost_model(step=0.01, tokens=0.001, decode_context=1e-5)
    # A pool of 20 blocks of 4 tokens and a 16-token budget: chunked prefill, prefix hits and
    # preemptions all happen.
    args = EngineArgs(model=model_dir, dtype="float32", block_size=BLOCK, num_gpu_blocks_override=20,
                      max_num_batched_tokens=16, max_num_seqs=6, max_model_len=64,
                      scheduling_policy=policy, disable_log_stats=True)
    requests = workload(seed)
    engine_log = run_engine(model_dir, args, requests, model)
    sim_log = run_sim(args, requests, model)
    assert any(preempted for _, _, preempted in engine_log), "the workload should preempt"
    assert sim_log == engine_log

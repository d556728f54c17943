"""The simulator runs int8 K/V for low-priority requests with the engine's own block sizes: the
tokens an int8 block holds come from the profile's head size and dtype (as the engine computes
them), so a simulated pool holds what the real one would; a profile without head_dim is refused."""

from __future__ import annotations

import pytest

from tests.core.helpers import assert_no_leaks
from tests.sim.helpers import cost_model
from tokenweir.config import EngineArgs
from tokenweir.core.cost_model import load_cost_model
from tokenweir.request import SchedulingHints
from tokenweir.sim.simulator import SimRequest, Simulator


def _requests() -> list[SimRequest]:
    return [SimRequest(f"r{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 300)), 100, 0.01 * i,
                       hints=SchedulingHints(priority=i % 2)) for i in range(16)]


def test_the_shipped_profile_simulates_int8_with_the_engines_block_size():
    profile = load_cost_model(None)
    results = {}
    for dtype in ("auto", "int8"):
        # 140 blocks of 16: 2,240 tokens for 16 requests of 400.
        sim = Simulator.from_engine_args(EngineArgs(num_gpu_blocks_override=140, low_priority_kv_cache_dtype=dtype),
                                         profile)
        results[dtype] = sim.run(_requests())
        assert_no_leaks(sim.scheduler)
        if dtype == "int8":
            assert sim.scheduler.kv_cache_manager.int8_block_size == 28  # bf16, head_dim 64, blocks of 16
    assert all(r.output_tokens == 100 for r in results["int8"].records)
    # The same pool holds more requests at once (preemptions may then rise: more of them grow).
    assert max(results["int8"].timeseries.running) > max(results["auto"].timeseries.running)


def test_a_profile_without_head_dim_is_refused_for_int8():
    with pytest.raises(ValueError, match="needs the profile's head_dim"):
        Simulator.from_engine_args(EngineArgs(low_priority_kv_cache_dtype="int8"), cost_model(step=0.1))
    model = cost_model(step=0.1)
    model.metadata["head_dim"] = 16  # float32: 16 x 16 x 4 bytes hold 51 int8 tokens with scales, 50 even
    sim = Simulator.from_engine_args(EngineArgs(low_priority_kv_cache_dtype="int8"), model)
    assert sim.scheduler.kv_cache_manager.int8_block_size == 50

"""Synthetic cost profiles for simulator tests."""

from __future__ import annotations

import json
from pathlib import Path

from tokenweir.core.cost_model import FEATURES, StepCostModel

# What `tokenweir profile` records about the engine, for a small made-up model.
METADATA = {"model": "synthetic", "dtype": "float32", "device": "cpu", "device_name": "test",
            "measured_at": "2026-01-01T00:00:00Z", "max_model_len": 4096,
            "kv_cache_bytes": 1024 * 16 * 100, "kv_bytes_per_block": 1024 * 16, "block_size": 16}


def cost_model(**coefficients: float) -> StepCostModel:
    """Every coefficient 0 unless given: `cost_model(step=0.1)` makes each step take 0.1 s."""
    coef = {name: 0.0 for name in FEATURES}
    coef.update(coefficients)
    return StepCostModel(coef, swap_bytes_per_second=1e9, metadata=dict(METADATA))


def write_profile(path: Path, model: StepCostModel) -> Path:
    path.write_text(json.dumps(model.to_dict()))
    return path

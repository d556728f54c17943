"""Batch controllers, chosen by name (`batch_controller`). Adding one is a module with its
controller (and config dataclass) and one entry in BATCH_CONTROLLERS; the scheduler loop only
knows `BatchController`."""

from __future__ import annotations

from typing import Any, Optional

from tokenweir.core.batch_control import BatchController, StaticBatchController, StepLimits
from tokenweir.core.batch_slo import SLOBatchConfig, SLOBatchController
from tokenweir.core.cost_model import StepCostModel

BATCH_CONTROLLERS: dict[str, type[BatchController]] = {
    c.name: c for c in (StaticBatchController, SLOBatchController)}


def check_batch_control(name: str, config: Any) -> None:
    if not isinstance(name, str) or name not in BATCH_CONTROLLERS:
        raise ValueError(f"batch_controller must be one of {sorted(BATCH_CONTROLLERS)}, got {name!r}")
    expected = BATCH_CONTROLLERS[name].config_class
    if expected is None and config is not None:
        raise ValueError(f"batch controller {name!r} takes no config, got {type(config).__name__}")
    if expected is not None and type(config) is not expected:
        raise ValueError(f"batch controller {name!r} takes a {expected.__name__}, got "
                         f"{type(config).__name__ if config is not None else None}")


def create_batch_controller(name: str, config: Any, limits: StepLimits, *,
                            cost_model: Optional[StepCostModel] = None, watermark: float = 0.0) -> BatchController:
    """The controller `name` within `limits` (the configured maxima)."""
    check_batch_control(name, config)
    return BATCH_CONTROLLERS[name].from_config(config, limits, cost_model, watermark)


__all__ = ["BATCH_CONTROLLERS", "SLOBatchConfig", "check_batch_control", "create_batch_controller"]

"""Observing what the engine's scheduler decided, for tests that must show a scenario happened."""

from __future__ import annotations

from tokenweir.core.scheduler import SchedulerOutput
from tokenweir.engine.core import EngineCore


def record_schedules(engine: EngineCore) -> list[SchedulerOutput]:
    """Every SchedulerOutput the engine's scheduler returns from now on, in order."""
    outputs: list[SchedulerOutput] = []
    schedule = engine.scheduler.schedule

    def recording(*args, **kwargs) -> SchedulerOutput:
        outputs.append(schedule(*args, **kwargs))
        return outputs[-1]

    engine.scheduler.schedule = recording
    return outputs


def num_continued_prefill_chunks(outputs: list[SchedulerOutput]) -> int:
    """Steps in which a request already running got more than one token: the second and later
    chunks of a chunked prefill (a decode step gives exactly one)."""
    return sum(1 for out in outputs for cached in out.scheduled_cached_reqs
               if out.num_scheduled_tokens.get(cached.request_id, 0) > 1)

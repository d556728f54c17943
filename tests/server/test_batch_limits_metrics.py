"""The batch controller's decisions are visible: two gauges and, for an adaptive controller,
the periodic log line."""

from __future__ import annotations

import logging

from prometheus_client import generate_latest

from tokenweir.core.batch_control import StepLimits
from tokenweir.core.kv_cache_manager import PrefixCacheStats
from tokenweir.core.scheduler import SchedulerStats
from tokenweir.metrics import EngineMetrics, StatsLogger


def _stats(controller: str, batch_control: dict | None = None) -> SchedulerStats:
    return SchedulerStats(num_running=3, num_waiting=0, num_swapped=0, kv_cache_usage=0.5, num_preemptions=0,
                          prefix_cache=PrefixCacheStats(), batch_controller=controller,
                          batch_limits=StepLimits(384, 24), batch_control=batch_control or {})


def test_gauges_show_the_latest_step_limits():
    metrics = EngineMetrics("m", 2048, 4096)
    metrics.record_scheduler_stats(_stats("slo"))
    text = generate_latest(metrics.registry).decode()
    assert 'tokenweir:batch_max_num_batched_tokens{model_name="m"} 384.0' in text
    assert 'tokenweir:batch_max_num_seqs{model_name="m"} 24.0' in text


def test_the_log_line_names_an_adaptive_controllers_limits_only(caplog):
    with caplog.at_level(logging.INFO, logger="tokenweir"):
        for controller in ("slo", "static"):
            log = StatsLogger(interval_s=1.0, now=0.0)
            log.add_tokens(10, 10)
            log.maybe_log(_stats(controller), now=2.0)
    slo_line, static_line = caplog.messages
    assert slo_line.endswith(", Batch limits (slo): 384 tokens, 24 seqs")
    assert "Batch limits" not in static_line


def test_the_log_line_says_when_the_minimum_budget_cannot_meet_the_target(caplog):
    with caplog.at_level(logging.INFO, logger="tokenweir"):
        for over in (True, False):
            log = StatsLogger(interval_s=1.0, now=0.0)
            log.add_tokens(10, 10)
            log.maybe_log(_stats("slo", {"min_budget_over_target": over}), now=2.0)
    over_line, fine_line = caplog.messages
    assert over_line.endswith(", Batch limits (slo): 384 tokens, 24 seqs (min budget over the target)")
    assert fine_line.endswith(", Batch limits (slo): 384 tokens, 24 seqs")


def test_the_log_line_says_when_the_cap_is_held_under_a_knee(caplog):
    with caplog.at_level(logging.INFO, logger="tokenweir"):
        for knee in (9, None):
            log = StatsLogger(interval_s=1.0, now=0.0)
            log.add_tokens(10, 10)
            log.maybe_log(_stats("slo", {"min_budget_over_target": False, "broken_num_seqs": knee}), now=2.0)
    held_line, free_line = caplog.messages
    assert held_line.endswith(", Batch limits (slo): 384 tokens, 24 seqs (knee at 9 seqs)")
    assert free_line.endswith(", Batch limits (slo): 384 tokens, 24 seqs")

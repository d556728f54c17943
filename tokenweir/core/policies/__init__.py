"""Scheduling policies, chosen by name (`scheduling_policy`). Adding one is a new module here
and one line in POLICIES; the scheduler loop only knows `SchedulingPolicy`."""

from __future__ import annotations

from typing import Optional

from tokenweir.core.policies.base import PolicyConfig, SchedulingPolicy, ServedRequest, StepServed, served_rows
from tokenweir.core.policies.fcfs import FCFSPolicy
from tokenweir.core.policies.fair_share import VTCConfig, parse_tenant_weights
from tokenweir.core.policies.priority import PriorityPolicy, priority_key
from tokenweir.core.policies.sla import SLAPolicy
from tokenweir.core.policies.sla_score import ScoreParts, SLAConfig, priority_class
from tokenweir.core.policies.vtc import VTCPolicy

POLICIES: dict[str, type[SchedulingPolicy]] = {
    p.name: p for p in (FCFSPolicy, PriorityPolicy, SLAPolicy, VTCPolicy)}


def create_policy(name: str, config: Optional[PolicyConfig] = None) -> SchedulingPolicy:
    try:
        policy_class = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; choose one of {sorted(POLICIES)}") from None
    return policy_class(config)


__all__ = ["POLICIES", "FCFSPolicy", "PolicyConfig", "PriorityPolicy", "SLAConfig", "SLAPolicy", "SchedulingPolicy",
           "ScoreParts", "ServedRequest", "StepServed", "VTCConfig", "VTCPolicy", "create_policy", "parse_tenant_weights",
           "priority_class", "priority_key", "served_rows"]

"""Scheduling policies, chosen by name (`scheduling_policy`). Adding one is a new module here
and one line in POLICIES; the scheduler loop only knows `SchedulingPolicy`."""

from __future__ import annotations

from typing import Optional

from tokenweir.core.policies.base import PolicyConfig, SchedulingPolicy, ServedRequest
from tokenweir.core.policies.fcfs import FCFSPolicy
from tokenweir.core.policies.priority import PriorityPolicy, priority_key

POLICIES: dict[str, type[SchedulingPolicy]] = {p.name: p for p in (FCFSPolicy, PriorityPolicy)}


def create_policy(name: str, config: Optional[PolicyConfig] = None) -> SchedulingPolicy:
    try:
        policy_class = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; choose one of {sorted(POLICIES)}") from None
    return policy_class(config)


__all__ = ["POLICIES", "FCFSPolicy", "PolicyConfig", "PriorityPolicy", "SchedulingPolicy", "ServedRequest",
           "create_policy", "priority_key"]

"""How a victim is preempted: recompute (free its blocks, prefill again later) or swap (copy its
blocks to the host tier, copy them back later).

`preemption_mode` `recompute` and `swap` fix the answer; `auto` prices both for each victim with
the step cost model and takes the cheaper: recompute costs the prefill of the victim's computed
tokens less those expected to be found in the prefix cache on its return (its blocks that other
requests hold stay cached); swap costs the bytes copied out and back in. Whatever the mode, a
victim that the host tier cannot take, or one with nothing computed, is recomputed: running out
of swap space degrades to recompute, it never fails a request.
"""

from __future__ import annotations

from typing import Literal, Protocol

from tokenweir.core.kv_cache_manager import KVCacheManager
from tokenweir.request import Request

PreemptionKind = Literal["recompute", "swap"]
PREEMPTION_KINDS: tuple[PreemptionKind, ...] = ("recompute", "swap")


class PreemptionCosts(Protocol):
    """The two terms of the step cost model (core/cost_model.py) that price a preemption."""

    def prefill_seconds(self, num_tokens: int, num_context: int = 0) -> float: ...

    def swap_seconds(self, num_bytes: int) -> float: ...


class PreemptionChooser:
    def __init__(self, mode: str, kv_cache_manager: KVCacheManager, costs: PreemptionCosts,
                 kv_block_bytes: int) -> None:
        self.mode = mode
        self.kv = kv_cache_manager
        self.costs = costs
        self.kv_block_bytes = kv_block_bytes

    def choose(self, victim: Request, *, may_swap: bool = True) -> PreemptionKind:
        """`may_swap` False: the step already swapped in, and copies in both directions in one
        step could overwrite each other's blocks."""
        if self.mode == "recompute" or not may_swap or not self.kv.can_swap_out(victim):
            return "recompute"
        if self.mode == "swap":
            return "swap"
        return "swap" if self.swap_seconds(victim) < self.recompute_seconds(victim) else "recompute"

    def recompute_seconds(self, victim: Request) -> float:
        num_hit = min(self.kv.get_num_shared_blocks(victim) * self.kv.tokens_per_block(victim), victim.num_computed_tokens)
        return self.costs.prefill_seconds(victim.num_computed_tokens - num_hit, num_context=num_hit)

    def swap_seconds(self, victim: Request) -> float:
        num_out = self.kv.get_num_swap_blocks(victim)
        num_in = num_out - self.kv.get_num_shared_blocks(victim)  # shared ones are found cached
        return self.costs.swap_seconds((num_out + num_in) * self.kv_block_bytes)

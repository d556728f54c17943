"""Virtual Token Counters (VTC; Sheng et al., "Fairness in Serving Large Language Models",
OSDI'24): per-tenant counts of weighted service, the fair-share state of `vtc` and of `sla`'s
tenant term.

A tenant's counter grows by `input_weight` per prompt token computed for it and `output_weight`
per token generated, divided by the tenant's weight (weight 2: twice the share). The tenant
served next is the backlogged one (a request waiting) with the smallest counter. A tenant that
becomes backlogged is lifted to the smallest counter of the other backlogged tenants (or, with
none, to the counter of the tenant last chosen), so time spent idle is not banked as credit.
That rule gives VTC its bound: the counters of two backlogged tenants stay within 2U of each
other, U the most that one request's admission or one step can add to one counter (the paper's
Theorem, which has no preemption; with weights, counters are in weighted units). A preempted
request's tenant keeps the credit it is owed (no lift when the request is put back), so under
preemption the gap can exceed 2U (a review's random runs with KV pressure: up to 4.8U with
recompute, 5.7U with swap, about as often as before that rule).

Tokens computed again after a recompute preemption and prefix-cache hits are not charged: the
tenant did not ask for that work.

The paper charges a request's input at admission; here the counters are charged with what each
step computed, after it. So that the admissions of one step still alternate between tenants
(charged after the step alone, the tenant behind would take every slot of a step whatever the
prompts' sizes), a request taken from the queue for admission counts its prompt tokens not yet
computed provisionally (`charge_admission`), until it goes back to the queue (`put_back`) or
the step is scheduled (`drop_provisional`); the step's `charge` then counts what it computed.
Only a new arrival lifts a tenant: a request put back (passed over, preempted, swapped out)
leaves its tenant's counter alone, as it was not idle and is owed the service it lost.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import json
import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from tokenweir.checks import is_finite_number
from tokenweir.core.policies.base import PolicyConfig, ServedRequest, served_parts
from tokenweir.request import Request

# Idle tenants (not backlogged) whose counters are kept before any is pruned: a deployment with
# fewer never loses one; a client inventing tenant names cannot grow the counters past it.
PRUNE_SLACK = 1024

Tenant = Optional[str]  # None: requests that name no tenant share one counter
_TENANT = operator.attrgetter("hints.tenant")


def parse_tenant_weights(text: Optional[str]) -> dict[str, float]:
    """`name=weight,name=weight`, or `@path` to a JSON object {name: weight}."""
    if not text:
        return {}
    if text.startswith("@"):
        path = Path(text[1:])
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ValueError(f"vtc_tenant_weights file {str(path)!r} cannot be read as JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError(f"vtc_tenant_weights file {str(path)!r} must hold a JSON object {{tenant: weight}}")
        items = list(data.items())
    else:
        items = []
        for part in text.split(","):
            name, sep, value = part.partition("=")
            if not sep or not name.strip():
                raise ValueError(f"vtc_tenant_weights: bad item {part!r}; use name=weight,name=weight or @file.json")
            try:
                items.append((name.strip(), float(value)))
            except ValueError:
                raise ValueError(f"vtc_tenant_weights: weight of {name.strip()!r} is not a number: {value!r}") from None
    weights = {}
    for name, weight in items:
        if str(name) in weights:
            raise ValueError(f"vtc_tenant_weights: tenant {name!r} is given twice")
        if not is_finite_number(weight) or weight <= 0:
            raise ValueError(f"vtc_tenant_weights: the weight of {name!r} must be a number > 0, got {weight!r}")
        weights[str(name)] = float(weight)
    return weights


@dataclass(frozen=True)
class VTCConfig(PolicyConfig):
    input_weight: float = 1.0  # counter units per prompt token computed (the paper's w_p)
    output_weight: float = 2.0  # counter units per generated token (the paper's w_q)
    # Tenant -> weight (share relative to weight-1 tenants); absent tenants weigh 1.
    tenant_weights: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("input_weight", "output_weight"):
            value = getattr(self, name)
            if not is_finite_number(value) or value < 0:
                raise ValueError(f"vtc {name} must be a number >= 0, got {value!r}")
        if self.input_weight == 0 and self.output_weight == 0:
            raise ValueError("vtc input_weight and output_weight cannot both be 0: no service would count")
        for tenant, weight in self.tenant_weights.items():
            if not isinstance(tenant, str):
                raise ValueError(f"vtc tenant weights are keyed by tenant name (a string), got {tenant!r}")
            if not is_finite_number(weight) or weight <= 0:
                raise ValueError(f"vtc tenant weight of {tenant!r} must be a number > 0, got {weight!r}")


def fresh_prompt_tokens(served: ServedRequest) -> int:
    """Prompt tokens computed for the first time in this step (neither a prefix-cache hit nor
    recomputation after a preemption): the computed range is [end - computed, end) and its
    first `recomputed` tokens were computed before."""
    request = served.request
    end = request.num_computed_tokens
    fresh_start = end - served.num_computed_tokens + served.num_recomputed_tokens
    return max(0, min(end, request.num_prompt_tokens) - fresh_start)


class VirtualTokenCounters:
    """The counters and the backlogged set, with the smallest-counter tenant found through a
    heap with lazy deletion (an entry is stale once the counter moved or the tenant left)."""

    def __init__(self, config: VTCConfig) -> None:
        self.config = config
        self.counters: dict[Tenant, float] = {}
        self._backlog: dict[Tenant, int] = {}  # tenant -> number of its waiting requests
        self._heap: list[tuple[float, int, Tenant]] = []
        self._seq = itertools.count()
        # The tenant most recently chosen: with nobody backlogged, a newcomer is lifted to its
        # counter as it is then (the service it got since it was chosen included).
        self._last_chosen: Optional[Tenant] = None
        self._last_chosen_counter = 0.0  # its counter, kept should its entry be pruned
        # The request whose taking made its tenant the last chosen, and per request taken this
        # step what was last chosen before it: a request put back (tried and passed over) was
        # not chosen after all, so the lift rule must not read its tenant.
        self._last_chosen_request: Optional[str] = None
        self._chosen_before: dict[str, tuple[Optional[str], Optional[Tenant], float]] = {}
        # This step's provisional charges (charge_admission): per request id (tenant, units),
        # and their sum per tenant, which the counters hold on top of what was charged.
        self._provisional: dict[str, tuple[Tenant, float]] = {}
        self._pending: dict[Tenant, float] = {}

    def weight(self, tenant: Tenant) -> float:
        return self.config.tenant_weights.get(tenant, 1.0) if tenant is not None else 1.0

    def counter(self, tenant: Tenant) -> float:
        return self.counters.get(tenant, 0.0)

    def floor(self) -> float:
        """What a newly backlogged tenant is lifted to: the smallest backlogged counter, or with
        nobody backlogged the counter of the tenant chosen last."""
        low = self.min_backlogged_counter()
        return low if low is not None else self._last_chosen_value()

    def _last_chosen_value(self) -> float:
        """The last chosen tenant's counter, remembered across the pruning of its entry."""
        if self._last_chosen in self.counters:
            self._last_chosen_counter = self.counters[self._last_chosen]
        return self._last_chosen_counter

    def is_backlogged(self, tenant: Tenant) -> bool:
        return tenant in self._backlog

    @property
    def backlogged(self) -> Iterable[Tenant]:
        return self._backlog.keys()

    def add_waiting(self, tenant: Tenant, arrival: bool = True) -> None:
        """A request of `tenant` starts waiting: a new arrival (`arrival`) or one put back. The
        lift rule applies to an arrival whose tenant was not backlogged (to a request put back
        only if its tenant's counter was pruned meanwhile): a lift raises what was charged, the
        step's provisional charges stay on top of it."""
        count = self._backlog.get(tenant, 0)
        if count == 0 and (arrival or tenant not in self.counters):
            # The floor first, of the others: once backlogged, its own stale heap entry could be it.
            pending = self._pending.get(tenant, 0.0)
            self.counters[tenant] = max(self.counter(tenant) - pending, self.floor()) + pending
        self._backlog[tenant] = count + 1
        if count == 0:
            self._push(tenant)  # once backlogged: a heap rebuild in _push keeps the backlogged only

    def remove_waiting(self, tenant: Tenant) -> None:
        count = self._backlog[tenant] - 1
        if count:
            self._backlog[tenant] = count
            return
        del self._backlog[tenant]
        if len(self.counters) > len(self._backlog) + PRUNE_SLACK:
            self._prune()

    def _prune(self) -> None:
        """Forget idle tenants' counters (one per tenant name ever seen would grow without bound,
        and names come from clients), least served first, down to PRUNE_SLACK / 2 idle ones, so
        a pass comes at most once per PRUNE_SLACK / 2 tenants added. One at or below the floor
        loses nothing (it would be lifted to the floor on return); one above it restarts at the
        floor, gaining at most its lead, and only past PRUNE_SLACK idle tenants. A pruned tenant
        still running is charged from the floor on (see `charge`)."""
        self._last_chosen_value()  # remembered before its entry may go
        idle = sorted((t for t in self.counters if t not in self._backlog), key=self.counters.__getitem__)
        for tenant in idle[:max(0, len(idle) - PRUNE_SLACK // 2)]:
            del self.counters[tenant]

    def charge_admission(self, request: Request) -> None:
        """`request` was taken from the queue to be admitted: its tenant counts its prompt tokens
        not yet computed until the step's `charge` (see the module docstring)."""
        units = self.config.input_weight * max(0, request.num_prompt_tokens - request.max_computed_tokens)
        if units > 0:
            tenant = request.tenant
            units /= self.weight(tenant)
            self._provisional[request.request_id] = (tenant, units)
            self._shift(tenant, units)

    def put_back(self, request: Request) -> None:
        """`request` goes back to wait (passed over, preempted, swapped out; not a new arrival):
        its provisional charge, if any, is taken back, and its tenant is not lifted."""
        entry = self._provisional.pop(request.request_id, None)
        if entry is not None:
            self._shift(entry[0], -entry[1])
        before = self._chosen_before.pop(request.request_id, None)
        if before is not None and self._last_chosen_request == request.request_id:
            self._last_chosen_request, self._last_chosen, self._last_chosen_counter = before
        self.add_waiting(request.tenant, arrival=False)

    def _shift(self, tenant: Tenant, units: float) -> None:
        pending = self._pending.get(tenant, 0.0) + units
        if abs(pending) < 1e-9:  # every provisional charge of the tenant taken back
            self._pending.pop(tenant, None)
        else:
            self._pending[tenant] = pending
        if tenant in self.counters:  # a pruned one restarts at the floor when charged
            self.counters[tenant] += units
            if tenant in self._backlog:
                self._push(tenant)

    def drop_provisional(self) -> None:
        """Take out the provisional charges once the step is scheduled (the policies'
        `end_step`): they only order the step's own admissions. Until the step's results come
        back (`charge`) the counters then hold what earlier steps computed, which is what a
        tenant arriving meanwhile is lifted to, and a step that fails leaves nothing behind."""
        for tenant, units in self._pending.items():
            if tenant in self.counters:
                self.counters[tenant] -= units
                if tenant in self._backlog:
                    self._push(tenant)
        self._pending.clear()
        self._provisional.clear()
        self._chosen_before.clear()

    def charge(self, served: Sequence[ServedRequest]) -> None:
        cfg = self.config
        w_in, w_out = cfg.input_weight, cfg.output_weight
        rows, decode_requests, _ = served_parts(served)
        # A plain decode row is one output token, never a prompt token: counted per tenant in C,
        # as this runs for every decode row of every step.
        growth: dict[Tenant, float] = {tenant: w_out * count
                                       for tenant, count in collections.Counter(map(_TENANT, decode_requests)).items()}
        for request, num_computed, num_recomputed, num_output in rows:
            tokens = w_out * num_output
            # fresh_prompt_tokens(), inlined: this loop runs for every request of every step.
            num_prompt, end = len(request.prompt_token_ids), request.num_computed_tokens
            fresh_start = end - num_computed + num_recomputed
            if fresh_start < num_prompt:
                tokens += w_in * max(0, min(end, num_prompt) - fresh_start)
            if tokens:
                tenant = request.hints.tenant
                growth[tenant] = growth.get(tenant, 0.0) + tokens
        counters = self.counters
        for tenant, tokens in growth.items():
            # A tenant missing here was pruned at or below the floor: charged from the floor.
            start = counters[tenant] if tenant in counters else self.floor()
            counters[tenant] = start + tokens / self.weight(tenant)
            if tenant in self._backlog:
                self._push(tenant)

    def min_backlogged(self, among: Optional[Mapping[Tenant, object]] = None) -> Tenant:
        """The backlogged tenant with the smallest counter (ties: the earlier entry). With
        `among`, only tenants in it count (a scan: used for the few tenants of one band; ties:
        by name)."""
        if among is not None:
            # Ties by name (None first), not by `among`'s order: a queue may re-create a
            # tenant's entry when it puts back a request it took, and moving the tenant to the
            # end then must not change who wins a tie. (A backlogged tenant always has a
            # counter: add_waiting sets it, pruning spares it.)
            counters = self.counters
            return min(among, key=lambda t: (counters[t], t is not None, t or ""))
        heap = self._heap
        while heap:
            value, _, tenant = heap[0]
            if tenant in self._backlog and self.counters.get(tenant) == value:
                return tenant
            heapq.heappop(heap)
        raise LookupError("no tenant is backlogged")

    def min_backlogged_counter(self) -> Optional[float]:
        if not self._backlog:
            return None
        return self.counter(self.min_backlogged())

    def note_chosen(self, request: Request) -> None:
        """`request` is taken from the queue to be admitted: its tenant is the last chosen,
        unless it is put back (`put_back`)."""
        self._chosen_before[request.request_id] = (self._last_chosen_request, self._last_chosen,
                                                   self._last_chosen_value())
        self._last_chosen_request, self._last_chosen = request.request_id, request.tenant

    def _push(self, tenant: Tenant) -> None:
        heapq.heappush(self._heap, (self.counter(tenant), next(self._seq), tenant))
        if len(self._heap) > 4 * len(self._backlog) + 64:  # drop stale entries now and then
            self._heap = [(self.counter(t), next(self._seq), t) for t in self._backlog]
            heapq.heapify(self._heap)

    def snapshot(self, limit: int = 64) -> dict[Tenant, float]:
        """Counters of the backlogged tenants, smallest first (at most `limit`: bounded output)."""
        return dict(sorted(((t, self.counter(t)) for t in self._backlog), key=lambda kv: kv[1])[:limit])

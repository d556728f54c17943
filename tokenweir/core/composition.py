"""Batch composition: which request of the policy's band is admitted next.

A policy ranks the waiting requests; an admission order reorders only among requests the policy
ranks alike, a *band* (the waiting queue says which: `RequestQueue.band`):
- fcfs: one band, the whole queue (arrival order is FCFS's only rule, and the aging bound below
  is what keeps it);
- priority: requests of equal `priority`, so a more important request is never passed;
- vtc: the requests of the tenant VTC serves next, so tenants' shares are untouched;
- sla: no band: its score sets every request apart (urgency, size, fairness, age), so the
  orders leave it alone.

Orders (`admission_order`): `policy`, the policy's own order, or one or more of the orders
below, each a key over the band's requests (smaller first) that may depend on what the step
chose so far:
- `cache-aware`: the longest cached prefix first (SGLang's longest prefix match). A request
  whose first uncached block is the first uncached block of a request chosen earlier in this
  step goes last: both would compute the same prefix, and one step later it hits. (Those that
  go last rank alike: none of them hits this step.)
- `length-aware`: the uncached prompt length closest to that of the step's first admission
  (all alike before it).
- `sampling-grouped`: requests whose kind (greedy or sampled) matches the running batch first,
  so that greedy requests run together and their steps take the sampler's argmax-only path
  (all alike while the batch is empty).
Several orders compose ("cache-aware,sampling-grouped", or a tuple of names): the request with
the smallest tuple of their keys, in the order given, is chosen; ties go in queue order. So the
first order decides, and the next ones only choose among the requests it ranks alike.

Within a band the order, not arrival, ranks: a waiting request may not preempt a running one of
its band unless it has waited the bound (priority's arrival tie-break would otherwise undo each
choice by preempting it again).

Aging bound: a request of the window that has waited `admission_max_wait` seconds goes first,
the earliest arrival of such requests first; so, once it has waited the bound, no request of its
band that arrived after it is admitted before it (the property test states it precisely). It,
the bands and the preemption rule are the same for one order and for several.
One exception, by design: with partial prefills (core/prefill_limits.py) a long prompt that
waits for a long-prefill slot lets shorter ones pass it where the policy allows, aged or not;
it cannot start before a slot frees anyway, and holding the shorts back would idle the step.

Cost: only the first `admission_window` requests of the band are considered, whatever the
queue's length; an order after the first keys only the requests the ones before it left tied;
a request's cached prefix is remembered (one memo for the orders that read it) and re-validated
with two lookups (the last hit still cached, the next block still not) instead of a walk over
its blocks. Nothing is reordered while the batch is full: then admission only preempts, and
that is the policy's call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Union

from tokenweir.checks import is_finite_number, is_integer
from tokenweir.core.block_hash import BlockHash
from tokenweir.core.kv_cache_manager import KVCacheManager
from tokenweir.core.queues import RequestQueue
from tokenweir.request import Request

ADMISSION_ORDERS = ("policy", "cache-aware", "length-aware", "sampling-grouped")


def parse_admission_order(value: object) -> tuple[str, ...]:
    """The orders `value` names: one name, names joined by commas, or a tuple or list of names.
    Refused: an unknown name, one named twice, and `policy` (no reordering) with others."""
    if isinstance(value, str):
        names = tuple(name.strip() for name in value.split(","))
    elif isinstance(value, (tuple, list)) and all(isinstance(name, str) for name in value):
        names = tuple(value)
    else:
        raise ValueError(f"admission_order must be a name, comma-separated names or a tuple or list of "
                         f"names, got {value!r}")
    if not names:
        raise ValueError(f"admission_order must name at least one of {ADMISSION_ORDERS}, got {value!r}")
    for name in names:
        if name not in ADMISSION_ORDERS:
            raise ValueError(f"admission_order must be one of {ADMISSION_ORDERS}, or several of those but "
                             f"'policy' joined by commas, got {name!r} in {value!r}")
        if names.count(name) > 1:
            raise ValueError(f"admission_order names {name!r} twice in {value!r}")
    if len(names) > 1 and "policy" in names:
        raise ValueError(f"admission_order 'policy' (the policy's own order, no reordering) cannot be combined "
                         f"with other orders, got {value!r}")
    return names


@dataclass(frozen=True)
class CompositionConfig:
    # One name or several (see parse_admission_order), kept as one comma-separated string so
    # that equal orders compare equal and print alike however they were given.
    admission_order: Union[str, tuple[str, ...], list[str]] = "policy"
    # Seconds: a request that has waited this long is no longer passed by later arrivals.
    max_wait: float = 30.0
    window: int = 32  # requests of the band an order chooses among

    def __post_init__(self) -> None:
        object.__setattr__(self, "admission_order", ",".join(parse_admission_order(self.admission_order)))
        if not is_finite_number(self.max_wait) or self.max_wait < 0:
            raise ValueError(f"admission_max_wait must be a number of seconds >= 0, got {self.max_wait!r}")
        if not is_integer(self.window) or self.window < 1:
            raise ValueError(f"admission_window must be an integer >= 1, got {self.window!r}")

    @property
    def orders(self) -> tuple[str, ...]:
        """The orders' names, the first deciding."""
        return tuple(str(self.admission_order).split(","))


class AdmissionOrder:
    """`policy`: pops in the policy's order. The base of the orders that choose within a band."""

    def __init__(self, config: CompositionConfig, kv_cache_manager: KVCacheManager, waiting: RequestQueue) -> None:
        self.config = config
        self.kv = kv_cache_manager
        self.waiting = waiting
        self.now = 0.0

    def begin_step(self, now: float, running: Sequence[Request]) -> None:
        self.now = now

    def pop(self, batch_full: bool) -> Request:
        """The next waiting request to try to admit, taken off the queue."""
        return self.waiting.pop()

    def forget(self, request: Request) -> None:
        """`request` left the queue otherwise than by `pop` (aborted, shed): drop what the
        order keeps of it."""

    def may_preempt(self, request: Request, victim: Request) -> bool:
        """Whether the order lets waiting `request` displace running `victim` (the policy must
        agree too)."""
        return True


class OrderKey:
    """One order within a band: `keys` ranks requests (smaller first) given the step so far."""

    def begin_step(self, running: Sequence[Request]) -> None:
        """A new step, with these requests running."""

    def keys(self, requests: Sequence[Request]) -> list[int]:
        """Each request's rank, smaller first (one call per choice, not per request: with a
        call per request, cache-aware's choice measured about a third slower than before)."""
        raise NotImplementedError

    def chosen(self, request: Request) -> None:
        """Called with every request chosen from a band (the step's state may depend on it)."""


class BandOrder(AdmissionOrder):
    """Chooses within the first `window` requests of the head's band by the smallest tuple of
    its keys' values (ties in queue order), except that a request that has waited `max_wait`
    goes first."""

    def __init__(self, config: CompositionConfig, kv_cache_manager: KVCacheManager, waiting: RequestQueue,
                 keys: Sequence[OrderKey], matcher: _PrefixMatcher) -> None:
        super().__init__(config, kv_cache_manager, waiting)
        self.keys = tuple(keys)
        self.matcher = matcher

    def begin_step(self, now: float, running: Sequence[Request]) -> None:
        super().begin_step(now, running)
        for key in self.keys:
            key.begin_step(running)

    def pop(self, batch_full: bool) -> Request:
        waiting = self.waiting
        band = () if batch_full else waiting.band(self.config.window)
        if not band:  # a full batch, or a queue without bands
            chosen = waiting.pop()
        else:
            chosen = band[0] if len(band) == 1 else self._aged(band) or self.choose(band)
            waiting.take(chosen)
            for key in self.keys:
                key.chosen(chosen)
        self.forget(chosen)
        return chosen

    def forget(self, request: Request) -> None:
        self.matcher.forget(request)

    def may_preempt(self, request: Request, victim: Request) -> bool:
        # Within a band the order, not arrival, ranks: an earlier arrival preempting the request
        # chosen before it (priority's tie-break) would undo every choice, at the cost of its
        # work. Once it has waited the bound, policy order is back.
        return (not self.waiting.same_band(request, victim)
                or self.now - request.arrival_time >= self.config.max_wait)

    def _aged(self, band: Sequence[Request]) -> Optional[Request]:
        now, max_wait = self.now, self.config.max_wait
        oldest = None
        for request in band:  # waited as may_preempt reads it (a horizon now - max_wait rounds otherwise)
            if now - request.arrival_time >= max_wait and (oldest is None or request.arrival_time < oldest.arrival_time):
                oldest = request
        return oldest

    def choose(self, band: Sequence[Request]) -> Request:
        # Lexicographic, one key at a time: each later key ranks only the requests the keys
        # before it left tied (the same choice as the whole tuple's minimum, fewer lookups).
        *firsts, last = self.keys
        candidates = band
        for order in firsts:
            values = order.keys(candidates)
            best = min(values)
            candidates = [request for request, value in zip(candidates, values) if value == best]
        values = last.keys(candidates)
        return candidates[values.index(min(values))]  # the first of equals


class _PrefixMatcher:
    """Cached prefix blocks of waiting requests, remembered across steps. A remembered count is
    re-validated by two lookups (its last hit still cached, the block after it still not); only
    a count that fails that is recomputed. An estimate for ordering: admission looks up again."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        # id -> (request, its preemptions (its tokens change only then), hit blocks, blocks that could hit)
        self._memo: dict[str, tuple[Request, int, int, int]] = {}

    def forget(self, request: Request) -> None:
        """`request` left the queue (popped to be admitted, aborted, shed): its entry goes
        now, so the memo holds waiting requests only. Kept, finished requests would stay alive
        in it (their token lists too) and be freed in bulk, which CPython's collector counts
        against nothing, so it runs collections it need not (see _Item in
        policies/sla_queue.py). One put back is matched afresh, once."""
        self._memo.pop(request.request_id, None)

    def match(self, request: Request) -> tuple[int, int]:
        """(cached blocks, blocks that could hit) of the request's tokens."""
        memo = self._memo.get(request.request_id)
        if memo is not None and memo[0] is request and memo[1] == request.num_preemptions:
            _, _, n, most = memo
            hashes, cached = request.block_hashes, self.kv.block_pool.cached_block_hash_to_block
            if (n == 0 or hashes[n - 1] in cached) and (n == most or hashes[n] not in cached):
                return n, most
        _, num_tokens = self.kv.get_computed_blocks(request)
        bs = self.kv.tokens_per_block(request)
        n = num_tokens // bs
        most = (request.num_tokens - 1) // bs if self.kv.enable_caching else 0
        self._memo[request.request_id] = (request, request.num_preemptions, n, most)
        return n, most


class CacheAwareKey(OrderKey):
    """Minus its cached tokens, or 1 (after all others, all alike) if it would compute a prefix
    chosen this step: (would compute it, -cached tokens or 0) as one int, cheaper to compare.
    Tokens, not blocks: an int8 request's block holds more of them."""

    def __init__(self, matcher: _PrefixMatcher) -> None:
        self.matcher = matcher
        self._computing: set[BlockHash] = set()  # first uncached blocks of this step's choices

    def begin_step(self, running: Sequence[Request]) -> None:
        self._computing.clear()

    def keys(self, requests: Sequence[Request]) -> list[int]:
        match, computing = self.matcher.match, self._computing
        tokens_per_block = self.matcher.kv.tokens_per_block
        values = []
        for request in requests:
            n, most = match(request)
            values.append(1 if n < most and computing and request.block_hashes[n] in computing
                          else -n * tokens_per_block(request))
        return values

    def chosen(self, request: Request) -> None:
        n, most = self.matcher.match(request)
        if n < most:
            self._computing.add(request.block_hashes[n])


class LengthAwareKey(OrderKey):
    """|uncached tokens - those of the step's first admission| (0 before it)."""

    def __init__(self, matcher: _PrefixMatcher) -> None:
        self.matcher = matcher
        self._reference: Optional[int] = None  # uncached tokens of the step's first admission

    def begin_step(self, running: Sequence[Request]) -> None:
        self._reference = None

    def _uncached(self, request: Request) -> int:
        return request.num_tokens - self.matcher.match(request)[0] * self.matcher.kv.tokens_per_block(request)

    def keys(self, requests: Sequence[Request]) -> list[int]:
        reference = self._reference
        if reference is None:
            return [0] * len(requests)
        return [abs(self._uncached(request) - reference) for request in requests]

    def chosen(self, request: Request) -> None:
        if self._reference is None:
            self._reference = self._uncached(request)


class SamplingGroupedKey(OrderKey):
    """Whether its kind (greedy or not) differs from the batch's (0 for an empty batch)."""

    def __init__(self) -> None:
        self._greedy: Optional[bool] = None  # whether the batch so far is all greedy; None: empty

    def begin_step(self, running: Sequence[Request]) -> None:
        self._greedy = all(r.sampling_params.greedy for r in running) if running else None

    def keys(self, requests: Sequence[Request]) -> list[int]:
        # A mixed batch has lost the fast path: sampled requests join it, so that greedy ones
        # later run in batches of their own.
        greedy = self._greedy
        if greedy is None:
            return [0] * len(requests)
        return [request.sampling_params.greedy != greedy for request in requests]  # a bool is an int

    def chosen(self, request: Request) -> None:
        greedy = request.sampling_params.greedy
        self._greedy = greedy if self._greedy is None else self._greedy and greedy


def check_admission_order(config: CompositionConfig, policy: str, enable_prefix_caching: bool) -> None:
    """Refuse an order where it could do nothing (a silent no-op would be taken for one that
    works): EngineArgs asks before a model is loaded, the scheduler whatever built its configs."""
    order = config.admission_order
    if config.orders == ("policy",):
        return
    if policy == "sla":
        raise ValueError(f"admission_order {order!r} does nothing under scheduling_policy 'sla': its score "
                         "sets every waiting request apart, so there is no band of equals to reorder")
    if "cache-aware" in config.orders and not enable_prefix_caching:
        # In a combination too: without a cache its key ranks every request alike.
        raise ValueError("admission_order 'cache-aware' needs enable_prefix_caching (it orders by prefix-cache hits)")


def create_admission_order(config: CompositionConfig, kv_cache_manager: KVCacheManager,
                           waiting: RequestQueue) -> AdmissionOrder:
    if config.orders == ("policy",):
        return AdmissionOrder(config, kv_cache_manager, waiting)
    matcher = _PrefixMatcher(kv_cache_manager)  # one memo for the orders that read cached prefixes
    keys = {"cache-aware": lambda: CacheAwareKey(matcher), "length-aware": lambda: LengthAwareKey(matcher),
            "sampling-grouped": SamplingGroupedKey}
    return BandOrder(config, kv_cache_manager, waiting, [keys[name]() for name in config.orders], matcher)

"""How long an engine step takes, predicted from what the step computes.

One model serves every part that must reason about time without running the model: the
simulator (virtual step time), `auto` preemption (recompute against swap), the SLO batch
controller (the step time of a candidate budget) and policies that estimate remaining work.
It is fitted by `tokenweir profile` on the real engine and stored as JSON; the package ships a
profile of the default model on CPU (`load_cost_model(None)`).

A step's time is a linear function of a few features of its composition: per-step work (the
scheduler, the Python around the forward pass), per-token work (the weight matmuls), per-row
work (sampling, per-sequence attention set-up) and attention work (K/V tokens read by decode
rows, query-key pairs of prefill chunks), plus swap copies at a measured bandwidth. Linear in
features, so it can be fitted by least squares and read by a person. One feature bends: decode
rows beyond a knee (chosen by the fit) pay extra each. A few decode rows cost little more than
one (the step reads every weight once whatever the batch); beyond the knee each row adds its
own compute, and on a server each stream adds the output path's work on the same cores.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from operator import mul
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from tokenweir.core.scheduler import SchedulerOutput
    from tokenweir.request import Request

FORMAT = "tokenweir-step-cost/1"
DEFAULT_PROFILE = Path(__file__).resolve().parent.parent / "profiles" / "smollm2-135m-cpu.json"


@dataclass(frozen=True, slots=True)
class StepComposition:
    """What one step computes; the cost model's only input."""

    num_prefill_tokens: int = 0  # tokens of prompt (or recompute) chunks
    num_prefill_seqs: int = 0
    num_decode_seqs: int = 0  # rows computing one token after the prompt
    decode_context_tokens: int = 0  # K/V tokens the decode rows' attention reads
    # Query-key pairs of the prefill chunks: a chunk of n tokens after c computed ones reads
    # n*c + n*(n+1)/2 of them (causal).
    prefill_attention_pairs: int = 0
    num_sampled: int = 0  # rows that sample a token this step
    swap_bytes: int = 0  # K/V bytes copied between device and host tiers

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_seqs

    @property
    def num_seqs(self) -> int:
        return self.num_prefill_seqs + self.num_decode_seqs

    def __add__(self, other: StepComposition) -> StepComposition:
        # Field by field, not a loop over the slots: the SLO controller adds compositions for
        # every prefill chunk it cuts.
        return StepComposition(
            self.num_prefill_tokens + other.num_prefill_tokens, self.num_prefill_seqs + other.num_prefill_seqs,
            self.num_decode_seqs + other.num_decode_seqs, self.decode_context_tokens + other.decode_context_tokens,
            self.prefill_attention_pairs + other.prefill_attention_pairs, self.num_sampled + other.num_sampled,
            self.swap_bytes + other.swap_bytes)


def chunk_composition(num_tokens: int, num_computed: int, total_tokens: int,
                      num_prompt_tokens: int) -> StepComposition:
    """One request's share of a step: `num_tokens` computed after `num_computed` of its
    `total_tokens` (prompt plus outputs so far). It samples when the chunk reaches the end."""
    samples = int(num_computed + num_tokens >= total_tokens)
    if num_tokens == 1 and samples and num_computed >= num_prompt_tokens:
        return StepComposition(num_decode_seqs=1, decode_context_tokens=num_computed + 1,
                               num_sampled=1)
    pairs = num_tokens * num_computed + num_tokens * (num_tokens + 1) // 2
    return StepComposition(num_prefill_tokens=num_tokens, num_prefill_seqs=1,
                           prefill_attention_pairs=pairs, num_sampled=samples)


@dataclass(frozen=True, slots=True)
class RemainingWork:
    """The least a request still needs of the engine before it can finish (the scheduler's
    `least_remaining_work`): its tokens whose K/V are computed or would be found in the prefix
    cache now, and how many tokens it must still sample at least."""

    num_tokens: int  # prompt plus outputs so far
    num_prompt_tokens: int
    num_computed_tokens: int  # < num_tokens: at least its last token is computed again
    num_samples: int  # >= 1


@dataclass(slots=True)
class StepTally:
    """The composition of the step being built: the scheduler adds each request's share as it
    schedules it and takes a victim's back, so a policy that asks before every admission what
    the step costs so far (the SLO guard of `sla`) reads it without a pass over the step's rows.
    Decode rows are counted by the scheduler itself (two sums on its hottest path; a decode row
    samples, so num_sampled counts them when the composition is read)."""

    num_prefill_tokens: int = 0
    num_prefill_seqs: int = 0
    prefill_attention_pairs: int = 0
    num_prefill_sampled: int = 0  # prefill chunks that reach their request's end
    num_decode_seqs: int = 0
    decode_context_tokens: int = 0

    def add(self, chunk: StepComposition, sign: int = 1) -> None:
        """Add one request's share (chunk_composition), or take it back with sign -1."""
        self.num_prefill_tokens += sign * chunk.num_prefill_tokens
        self.num_prefill_seqs += sign * chunk.num_prefill_seqs
        self.prefill_attention_pairs += sign * chunk.prefill_attention_pairs
        self.num_decode_seqs += sign * chunk.num_decode_seqs
        self.decode_context_tokens += sign * chunk.decode_context_tokens
        self.num_prefill_sampled += sign * (chunk.num_sampled - chunk.num_decode_seqs)

    def composition(self) -> StepComposition:
        return StepComposition(self.num_prefill_tokens, self.num_prefill_seqs, self.num_decode_seqs,
                               self.decode_context_tokens, self.prefill_attention_pairs,
                               self.num_prefill_sampled + self.num_decode_seqs)

    def decodes(self) -> StepComposition:
        """The step's decode rows alone."""
        return StepComposition(num_decode_seqs=self.num_decode_seqs, decode_context_tokens=self.decode_context_tokens,
                               num_sampled=self.num_decode_seqs)


def step_composition(out: SchedulerOutput, requests: Mapping[str, Request],
                     kv_bytes_per_block: int = 0) -> StepComposition:
    """The composition of a step just scheduled (before `update_from_output` advances the
    requests), from the scheduler's live requests."""
    total = StepComposition()
    for rid, n in out.num_scheduled_tokens.items():
        r = requests[rid]
        total += chunk_composition(n, r.num_computed_tokens, r.num_tokens, r.num_prompt_tokens)
    swapped = len(out.blocks_to_swap_out) + len(out.blocks_to_swap_in)
    if swapped:
        total += StepComposition(swap_bytes=swapped * kv_bytes_per_block)
    return total


# The features, in the order of feature_vector's values; the fitted coefficients are seconds
# per unit of each.
FEATURES = ("step", "tokens", "seqs", "decode_context", "prefill_attention", "sampled", "small_step",
            "decode_beyond_knee")


def feature_vector(comp: StepComposition, small_step_max_tokens: int = 0,
                   decode_knee: int = 0) -> tuple[float, ...]:
    """Each feature of FEATURES read from a composition, given the profile's small-step bound
    and its decode knee. (One function, not one per feature: it runs for every prediction.)"""
    tokens, decode = comp.num_prefill_tokens + comp.num_decode_seqs, comp.num_decode_seqs
    return (1.0, tokens, comp.num_prefill_seqs + decode, comp.decode_context_tokens, comp.prefill_attention_pairs,
            comp.num_sampled,
            # `tokenweir serve --engine-in-process` runs steps of a few tokens on one thread
            # fewer (serving_threads.py): such a step pays a fixed extra that a larger one does not.
            float(0 < tokens <= small_step_max_tokens),
            # Decode rows beyond the knee (0: the profile has none).
            max(0, decode - decode_knee) if decode_knee else 0)


# What a profile file holds: the model, and the samples it was fitted to (`tokenweir profile`).
_PROFILE_KEYS = frozenset({"format", "coefficients", "swap_bytes_per_second", "small_step_max_tokens",
                           "decode_knee", "metadata", "samples"})


@dataclass(frozen=True)
class StepCostModel:
    coefficients: dict[str, float]  # seconds per unit of each feature in FEATURES
    swap_bytes_per_second: float  # device <-> host copy bandwidth
    # Where it was measured (model, dtype, device, threads, date) and how well it fits; not
    # used to predict, kept so a profile says what it is.
    metadata: dict[str, Any] = field(default_factory=dict)
    # Steps of up to this many tokens ran with fewer threads when profiled (0: none did).
    small_step_max_tokens: int = 0
    # Decode rows beyond this many pay `decode_beyond_knee` each (0: no knee).
    decode_knee: int = 0

    def __post_init__(self) -> None:
        missing = set(FEATURES) - set(self.coefficients)
        unknown = set(self.coefficients) - set(FEATURES)
        if missing or unknown:
            raise ValueError(f"cost model coefficients must name exactly {sorted(FEATURES)}; "
                             f"missing {sorted(missing)}, unknown {sorted(unknown)}")
        for name, value in self.coefficients.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"cost model coefficient {name!r} must be a finite number >= 0, "
                                 f"got {value!r}")
        bw = self.swap_bytes_per_second
        if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not math.isfinite(bw) or bw <= 0:
            raise ValueError(f"cost model swap_bytes_per_second must be a finite number > 0, got {bw!r}")
        for name in ("small_step_max_tokens", "decode_knee"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"cost model {name} must be an integer >= 0, got {value!r}")
        # Read once per prediction in the simulator's inner loop: keep them in feature order.
        object.__setattr__(self, "_weights", [float(self.coefficients[n]) for n in FEATURES])

    def predict(self, comp: StepComposition) -> float:
        """Seconds the step takes; an empty step costs nothing."""
        if comp.num_tokens == 0 and comp.swap_bytes == 0:
            return 0.0
        features = feature_vector(comp, self.small_step_max_tokens, self.decode_knee)
        compute = sum(map(mul, self._weights, features)) if comp.num_tokens else 0.0
        return compute + comp.swap_bytes / self.swap_bytes_per_second

    def prefill_seconds(self, num_tokens: int, num_context: int = 0) -> float:
        """The marginal time of computing `num_tokens` of one request after `num_context`
        cached ones inside a step (what a recompute costs), without the per-step term."""
        if num_tokens <= 0:
            return 0.0
        total = num_context + num_tokens
        features = feature_vector(chunk_composition(num_tokens, num_context, total, total))
        # Inside a step of other work: no per-step term (and the step is not a small one).
        return sum(w * x for name, w, x in zip(FEATURES, self._weights, features) if name != "step")

    def least_service_seconds(self, work: RemainingWork) -> float:
        """A lower bound, by this model, of the time a request with `work` left needs to finish
        from now: all of its remaining chunk in one step alone, then one decode step alone per
        further token. Any other schedule computes the same tokens in more steps or with other
        rows (every coefficient is >= 0), except the small-step extra, which a larger step would
        not pay: it is left out. Swap copies, the token budget's chunking and other requests'
        rows only add to it. A bound of the fitted model, not of the machine."""
        weights, knee = self._weights, self.decode_knee
        first = chunk_composition(work.num_tokens - work.num_computed_tokens, work.num_computed_tokens,
                                  work.num_tokens, work.num_prompt_tokens)
        total = sum(w * x for w, x in zip(weights, feature_vector(first, 0, knee)))
        n = work.num_samples - 1
        if n > 0:
            # Decode steps alone are linear in their context, which grows by one a step: n of the
            # first one's time plus the context's coefficient times 0 + 1 + ... + (n - 1).
            ctx = work.num_tokens + 1  # the tokens so far and the one the first step samples
            one = StepComposition(num_decode_seqs=1, decode_context_tokens=ctx, num_sampled=1)
            total += (n * sum(w * x for w, x in zip(weights, feature_vector(one, 0, knee)))
                      + self.coefficients["decode_context"] * n * (n - 1) / 2)
        return total

    def swap_seconds(self, num_bytes: int) -> float:
        return num_bytes / self.swap_bytes_per_second

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "coefficients": dict(self.coefficients),
                "swap_bytes_per_second": self.swap_bytes_per_second,
                "small_step_max_tokens": self.small_step_max_tokens, "decode_knee": self.decode_knee,
                "metadata": self.metadata}

    @classmethod
    def from_dict(cls, data: Any) -> StepCostModel:
        """A profile as `tokenweir profile` writes it. What a hand-edited one could get wrong
        without an error elsewhere is refused: a misspelt key (the term it names would silently
        be 0), a coefficient whose bound is 0 (it could never act), no time for a step at all."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a step cost profile: expected an object with \"format\": \"{FORMAT}\"")
        unknown = set(data) - _PROFILE_KEYS
        if unknown:
            raise ValueError(f"unknown keys {sorted(unknown)}; a profile has {sorted(_PROFILE_KEYS)}")
        try:
            coefficients = dict(data["coefficients"])
            if "decode_knee" not in data:  # written before the knee existed: it has none
                coefficients.setdefault("decode_beyond_knee", 0.0)
            model = cls(coefficients, data["swap_bytes_per_second"],
                        dict(data.get("metadata", {})), data.get("small_step_max_tokens", 0),
                        data.get("decode_knee", 0))
        except (KeyError, TypeError) as e:
            raise ValueError(f"step cost profile is missing or has a malformed field: {e}") from None
        for coefficient, bound in (("decode_beyond_knee", "decode_knee"), ("small_step", "small_step_max_tokens")):
            if model.coefficients[coefficient] > 0 and getattr(model, bound) == 0:
                raise ValueError(f"coefficient {coefficient!r} is {model.coefficients[coefficient]} but {bound} "
                                 "is 0 (or missing), so it could never act")
        if model.coefficients["step"] == 0 and model.coefficients["tokens"] == 0:
            raise ValueError("coefficients 'step' and 'tokens' are both 0: a step would take no time")
        return model


def load_cost_model(path: Optional[str | Path] = None) -> StepCostModel:
    """The profile at `path`, or the shipped profile of the default model on CPU."""
    path = Path(path) if path is not None else DEFAULT_PROFILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"cost profile {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cost profile {path} is not readable JSON: {e}") from None
    try:
        return StepCostModel.from_dict(data)
    except ValueError as e:
        raise ValueError(f"cost profile {path}: {e}") from None

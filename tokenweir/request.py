"""The request record shared by every layer: status, tokens, sampling parameters, timestamps.

No torch here: the scheduler, the simulator and the router import this module.
"""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass, field, fields
from typing import Optional, Union

from tokenweir.checks import is_finite_number, is_integer


class RequestStatus(enum.IntEnum):
    """Lifecycle of a request. Everything from FINISHED_STOPPED on is terminal."""

    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()  # recompute preemption: back in the waiting queue, blocks freed
    SWAPPED = enum.auto()  # swap preemption: blocks copied to host memory
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_IGNORED = enum.auto()  # the prompt can never fit (max_model_len or the KV pool)

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class FinishReason(str, enum.Enum):
    """What users see (OpenAI's `finish_reason`)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"

    def __str__(self) -> str:
        return self.value


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    # vLLM reports an ignored (never-fitting) prompt as "length": it ran out of room.
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
}


# Temperatures below this sample greedily (as vLLM's 1e-5: dividing by them would overflow).
GREEDY_TEMPERATURE = 1e-5


class ParameterError(ValueError):
    """A request parameter out of range; `param` names it (as a client spells it), so the
    server can answer with OpenAI's `param` field without parsing the message."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple:
        # Crosses from the engine process to the server's: rebuilt from both arguments.
        return (type(self), (self.param, str(self)))


def resolve_max_tokens(num_prompt_tokens: int, max_tokens: Optional[int], max_model_len: int, *,
                       prompt_param: str = "prompt", max_tokens_param: str = "max_tokens") -> int:
    """vLLM's length rule: a request whose prompt leaves no room for output, or whose prompt and
    max_tokens together exceed max_model_len, is refused (a ParameterError, a 400 on the server)
    rather than cut short; an unset max_tokens fills the rest of the context. The server and
    the simulator both apply it, so a simulated replay refuses what a real one would."""
    n, limit = num_prompt_tokens, max_model_len
    if n == 0:
        raise ParameterError(prompt_param, f"{prompt_param} is empty: it must contain at least one token")
    if n >= limit:
        raise ParameterError(
            prompt_param, f"This model's maximum context length is {limit} tokens, and `{prompt_param}` has "
            f"{n} tokens, which leaves no room for output. Please shorten `{prompt_param}`.")
    if max_tokens is None:
        return limit - n
    if n + max_tokens > limit:
        raise ParameterError(
            max_tokens_param, f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{n + max_tokens} tokens ({n} in `{prompt_param}`, {max_tokens} in "
            f"`{max_tokens_param}`). Please shorten `{prompt_param}` or lower `{max_tokens_param}`.")
    return max_tokens


# Integer knobs end up in int64 tensors (top_k, stop ids) or a 64-bit generator seed.
_INT64_LIMIT = 2**63

# Bounds on the stop conditions a request may carry (checked after every token).
MAX_STOP_STRINGS = 256
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
# generation_config.json keys vLLM takes as request defaults (`--generation-config auto`): the
# model's file and a request body's unset fields are read by the same names. The rest
# (do_sample, max_new_tokens, ...) is not a default of a request's sampling.
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# logit_bias is applied every step: bounded as the stop ids are (OpenAI allows 300 entries).
MAX_LOGIT_BIAS_ENTRIES = 1024
# A logit is divided by the penalty (or multiplied): a float32 logit divided by one much
# nearer 0 overflows to inf, and the probabilities become NaN. vLLM asks only > 0.
REPETITION_PENALTY_RANGE = (0.01, 100.0)

# Priorities are bounded so that scores built from them (the SLA policy) stay finite and exact.
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1
# A tenant name or cache salt is a key in per-tenant tables and a hashed block key: bounded.
MAX_KEY_CHARS = 256


def _check_key(name: str, value: object) -> None:
    if value is not None and (not isinstance(value, str) or not 0 < len(value) <= MAX_KEY_CHARS):
        raise ParameterError(name, f"{name} must be a non-empty string of at most {MAX_KEY_CHARS} characters "
                         f"or None, got {value!r:.80}")


def _check_seconds(name: str, value: object) -> None:
    if value is not None and (not is_finite_number(value) or value <= 0):
        raise ParameterError(name, f"{name} must be a finite number of seconds > 0 or None, got {value!r}")


@dataclass(frozen=True, slots=True)
class SchedulingHints:
    """What a client says about how its request should be scheduled, carried unchanged from
    the server (or `LLM`) through the engine to the `Request`. Plain values only, so it can be
    sent to another process (`to_dict` / `from_dict`). Validated on construction.

    Times are seconds. `deadline` is relative to arrival (finish within this many seconds), so
    the record means the same in every process whatever its clock; `arrival_time` is a value of
    the engine's monotonic clock, or None for "when the engine receives it".
    """

    priority: int = 0  # smaller is more important (vLLM's sense), in [PRIORITY_MIN, PRIORITY_MAX]
    tenant: Optional[str] = None
    deadline: Optional[float] = None
    ttft_slo: Optional[float] = None
    tpot_slo: Optional[float] = None
    cache_salt: Optional[str] = None  # requests with different salts never share cached blocks
    arrival_time: Optional[float] = None

    def __post_init__(self) -> None:
        if not is_integer(self.priority) or not PRIORITY_MIN <= self.priority <= PRIORITY_MAX:
            raise ParameterError("priority", f"priority must be an integer in [{PRIORITY_MIN}, {PRIORITY_MAX}], "
                             f"got {self.priority!r}")
        _check_key("tenant", self.tenant)
        _check_key("cache_salt", self.cache_salt)
        for name in ("deadline", "ttft_slo", "tpot_slo"):
            _check_seconds(name, getattr(self, name))
        if self.arrival_time is not None and not is_finite_number(self.arrival_time):
            raise ParameterError("arrival_time", f"arrival_time must be a finite number or None, got {self.arrival_time!r}")

    def to_dict(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, object]) -> SchedulingHints:
        unknown = set(data) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown scheduling hints {sorted(unknown)}")
        return cls(**data)  # type: ignore[arg-type]


@dataclass
class SamplingParams:
    """How to sample one request's output. Validated on construction (precise ValueErrors).

    `top_k` 0 or -1 and `top_p` 1.0 and `min_p` 0.0 mean "off"; `temperature` below 1e-5 (0 included) means greedy.
    `max_tokens=None` lets the request run until EOS or `max_model_len`.
    Penalties as in vLLM (and greedy rows too): `presence_penalty` and `frequency_penalty`
    (OpenAI's, over the output so far) subtract from a token's logit once if it occurred, and
    per occurrence; `repetition_penalty` (transformers' and vLLM's, over prompt and output)
    divides a positive logit of a token that occurred by it and multiplies a negative one.
    `logit_bias` adds {token id: bias} to the logits. 0, 0, 1 and None mean "off".
    """

    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Optional[dict[int, float]] = None
    stop: Union[None, str, list[str]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    seed: Optional[int] = None
    logprobs: Optional[int] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = 1

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (list, tuple)):
            self.stop = list(self.stop)
        else:
            raise ParameterError("stop", f"stop must be a non-empty string or a list of them, got {self.stop!r:.200}")
        if isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = list(self.stop_token_ids)
        elif self.stop_token_ids is None:
            self.stop_token_ids = []
        if isinstance(self.logit_bias, dict):  # the engine's copy: later edits of the caller's do not reach it
            self.logit_bias = dict(self.logit_bias)
        self._validate()

    def _validate(self) -> None:
        is_int, is_num = is_integer, is_finite_number
        if self.n != 1:
            raise ParameterError("n", f"n must be 1 (parallel sampling is not supported), got {self.n!r}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise ParameterError("max_tokens", f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise ParameterError("min_tokens", f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParameterError(
                "min_tokens", f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} "
                f"and max_tokens={self.max_tokens}")
        if not is_num(self.temperature) or self.temperature < 0:
            raise ParameterError("temperature", f"temperature must be a number >= 0, got {self.temperature!r}")
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ParameterError("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or not -1 <= self.top_k < _INT64_LIMIT:
            raise ParameterError("top_k", f"top_k must be -1 or 0 (off) or a positive integer below 2**63, got {self.top_k!r}")
        if not is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ParameterError("min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        # Every stop string is searched in the text after each token, and every stop id checked:
        # unbounded lists would let one request slow every other stream down.
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ParameterError("stop", f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
        if not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop):
            raise ParameterError("stop", "stop must be a string or a list of strings, each of 1 to "
                                 f"{MAX_STOP_STRING_CHARS} characters, got {self.stop!r:.200}")
        if not isinstance(self.stop_token_ids, list) or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ParameterError("stop_token_ids", f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} "
                                 f"token ids, got {self.stop_token_ids!r:.200}")
        if not all(is_int(t) and 0 <= t < _INT64_LIMIT for t in self.stop_token_ids):
            raise ParameterError("stop_token_ids", "stop_token_ids must be a list of non-negative integers, "
                                 f"got {self.stop_token_ids!r:.200}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ParameterError(name, f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.seed is not None and (not is_int(self.seed) or not -_INT64_LIMIT <= self.seed < 2 * _INT64_LIMIT):
            raise ParameterError("seed", f"seed must be an integer in [-2**63, 2**64) or None, got {self.seed!r}")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= 20):
            raise ParameterError("logprobs", f"logprobs must be an integer in [0, 20] or None, got {self.logprobs!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_num(value) or not -2.0 <= value <= 2.0:
                raise ParameterError(name, f"{name} must be a number in [-2, 2], got {value!r}")
        low, high = REPETITION_PENALTY_RANGE
        if not is_num(self.repetition_penalty) or not low <= self.repetition_penalty <= high:
            raise ParameterError("repetition_penalty", f"repetition_penalty must be in [{low:g}, {high:g}], "
                                 f"got {self.repetition_penalty!r}")
        if self.logit_bias is not None:
            bias = self.logit_bias
            if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS_ENTRIES:
                raise ParameterError("logit_bias", f"logit_bias must be a dict of at most {MAX_LOGIT_BIAS_ENTRIES} "
                                     f"{{token id: bias}} entries, got {bias!r:.200}")
            if not all(is_int(t) and 0 <= t < _INT64_LIMIT and is_num(b) and -100 <= b <= 100 for t, b in bias.items()):
                raise ParameterError("logit_bias", "logit_bias must map non-negative integer token ids to numbers in "
                                     f"[-100, 100], got {bias!r:.200}")

    @property
    def penalized(self) -> bool:
        """Whether a presence, frequency or repetition penalty reads this request's tokens."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


@dataclass(frozen=True)
class ResumeState:
    """What a client was already given of a request that another engine ran (failover): the
    request continues from it as if preempted by recompute, so the tokens, text, logprobs and a
    seeded request's random stream carry on where the stream stopped, with none repeated or
    skipped. `logprobs` is None when the request asked for none. The times (None where the
    engines' clocks differ) and preemption count carry the request's own metrics and SLO state
    over; the failover counts as one more preemption."""

    output_token_ids: tuple[int, ...]
    logprobs: Optional[tuple[dict[int, float], ...]] = None
    cumulative_logprob: float = 0.0
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    num_preemptions: int = 0


@dataclass(eq=False, slots=True)
class Request:
    """The live record of one request. The scheduler mutates it; everyone else reads it.

    `num_computed_tokens` counts tokens whose K/V are in the cache (prefix hits included);
    `num_cached_tokens` is how many prompt tokens the first admission found in the prefix cache.
    Times are whatever clock the caller passes in (`now=`); the scheduler never reads a clock.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = 0.0  # on the caller's clock; the scheduler never reads a clock
    eos_token_id: Optional[int] = None
    hints: SchedulingHints = field(default_factory=SchedulingHints)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # The most tokens whose K/V were ever computed for it: below this, a recompute preemption
    # makes it compute tokens again (which fair-share accounting does not charge).
    max_computed_tokens: int = 0
    num_cached_tokens: int = -1  # -1 until the first admission looks the prefix up
    num_preemptions: int = 0
    stop_reason: Union[None, int, str] = None  # the stop token id or stop string that ended it
    status_message: Optional[str] = None  # why it was ignored / failed
    # Chained hashes of this request's full blocks, extended as tokens arrive (see kv_cache_manager).
    block_hashes: list[int] = field(default_factory=list)
    # Its K/V are stored in int8 (a low-priority request; the KV cache manager decides when it is added).
    kv_int8: bool = False
    # Output tokens it was created with (`restore`: another engine produced them).
    num_restored_output_tokens: int = 0
    # Timestamps.
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None
    all_token_ids: list[int] = field(init=False)  # the prompt, then the outputs
    # The length at which it finishes by length (FINISHED_LENGTH): the prompt plus max_tokens,
    # within the max_model_len the scheduler sets when the request is added.
    max_num_tokens: int = field(init=False)
    # The tokens that finish it once past min_tokens: EOS unless ignored, and the stop ids.
    finishing_token_ids: frozenset[int] = field(init=False)

    def __post_init__(self) -> None:
        # What a request is made of; the token ids themselves (integers below the vocabulary
        # size) are the engine's one prompt check (EngineCore.validate_prompt), not repeated here.
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}")
        if isinstance(self.prompt_token_ids, (str, bytes)):
            raise ValueError(f"request {self.request_id!r}: prompt_token_ids must be token ids, not text")
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r}: the prompt must contain at least one token")
        if not isinstance(self.sampling_params, SamplingParams):
            raise ValueError(f"request {self.request_id!r}: sampling_params must be SamplingParams, "
                             f"got {type(self.sampling_params).__name__}")
        if not isinstance(self.hints, SchedulingHints):
            raise ValueError(f"request {self.request_id!r}: hints must be SchedulingHints, got {type(self.hints).__name__}")
        if not is_finite_number(self.arrival_time):
            raise ValueError(f"request {self.request_id!r}: arrival_time must be a finite number, got {self.arrival_time!r}")
        if self.eos_token_id is not None and (not is_integer(self.eos_token_id) or self.eos_token_id < 0):
            raise ValueError(f"request {self.request_id!r}: eos_token_id must be a token id or None, "
                             f"got {self.eos_token_id!r}")
        self.all_token_ids = list(self.prompt_token_ids)
        params = self.sampling_params
        self.max_num_tokens = sys.maxsize if params.max_tokens is None else len(self.prompt_token_ids) + params.max_tokens
        finishing = set(params.stop_token_ids or ())
        if self.eos_token_id is not None and not params.ignore_eos:
            finishing.add(self.eos_token_id)
        self.finishing_token_ids = frozenset(finishing)

    @property
    def priority(self) -> int:
        return self.hints.priority

    @property
    def tenant(self) -> Optional[str]:
        return self.hints.tenant

    @property
    def cache_salt(self) -> Optional[str]:
        return self.hints.cache_salt

    @property
    def deadline(self) -> Optional[float]:
        """Absolute time (arrival + the relative deadline) by which the request should finish."""
        return None if self.hints.deadline is None else self.arrival_time + self.hints.deadline

    @property
    def ttft_slo(self) -> Optional[float]:
        return self.hints.ttft_slo

    @property
    def tpot_slo(self) -> Optional[float]:
        return self.hints.tpot_slo

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def least_num_output_tokens(self) -> int:
        """The fewest output tokens it can end with: all it may have (max_tokens, cut to
        max_model_len once the scheduler has it) when it ignores EOS and has no stop ids or
        strings, else min_tokens (any token past them may stop it)."""
        most = self.max_num_tokens - self.num_prompt_tokens
        params = self.sampling_params
        if params.ignore_eos and not params.stop_token_ids and not params.stop and params.max_tokens is not None:
            return most
        return min(params.min_tokens, most)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> Optional[FinishReason]:
        return _FINISH_REASONS.get(self.status)

    def restore(self, resume: ResumeState) -> None:
        """Before the request is queued: give it the outputs another engine already produced
        (failover). It then waits as a request preempted by recompute does: every token is
        computed again (fair share does not charge them twice) and the next one sampled after
        them; max_tokens and min_tokens still count from its first output."""
        if self.status is not RequestStatus.WAITING or self.num_computed_tokens or self.output_token_ids:
            raise ValueError(f"request {self.request_id!r}: outputs can only be restored before it is queued")
        tokens = list(resume.output_token_ids)
        if not tokens or not all(is_integer(t) and t >= 0 for t in tokens):
            raise ValueError(f"request {self.request_id!r}: restored outputs must be token ids, got {tokens[:5]}")
        if len(self.all_token_ids) + len(tokens) >= self.max_num_tokens:
            raise ValueError(f"request {self.request_id!r}: {len(tokens)} restored outputs leave no token of its "
                             f"max_tokens ({self.sampling_params.max_tokens}) to generate")
        if (resume.first_token_time is None) != (resume.last_token_time is None):
            raise ValueError(f"request {self.request_id!r}: a resume state has both first and last token times or neither")
        for name in ("first_scheduled_time", "first_token_time", "last_token_time"):
            value = getattr(resume, name)
            if value is not None and not is_finite_number(value):
                raise ValueError(f"request {self.request_id!r}: {name} must be a finite number or None, got {value!r}")
        if not is_integer(resume.num_preemptions) or resume.num_preemptions < 0:
            raise ValueError(f"request {self.request_id!r}: num_preemptions must be an integer >= 0, "
                             f"got {resume.num_preemptions!r}")
        self.output_token_ids = tokens
        self.all_token_ids.extend(tokens)
        self.num_restored_output_tokens = len(tokens)
        self.max_computed_tokens = len(self.all_token_ids) - 1  # the newest token's K/V were never computed
        self.num_preemptions = resume.num_preemptions + 1
        self.first_scheduled_time = resume.first_scheduled_time
        self.first_token_time, self.last_token_time = resume.first_token_time, resume.last_token_time

    def append_output_token(self, token_id: int, now: float) -> bool:
        """Append a sampled token; whether it may have finished the request (its length or a
        finishing token: the scheduler's stop check runs only then, as this runs for every
        token of every request)."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self.last_token_time = now
        if self.first_token_time is None:
            self.first_token_time = now
        return len(self.all_token_ids) >= self.max_num_tokens or token_id in self.finishing_token_ids

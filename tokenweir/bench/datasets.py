"""Benchmark workloads: random lengths, a shared-prefix set, and replay of the Azure LLM trace.

Prompts are filler text of a target token length. Words are drawn at random for every
prompt so that two prompts share no prefix by accident: a server's prefix cache would
otherwise turn a "random" workload into a cache benchmark. Only the prefix dataset
shares text on purpose.

The trace dataset replays the Azure LLM inference trace 2023 (conversation;
Azure/AzurePublicDataset, published with the Splitwise paper, ISCA 2024), licensed
CC-BY 4.0, in vidur's processed column names: arrived_at, num_prefill_tokens,
num_decode_tokens.
"""

import csv
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

# Common English words that BPE tokenizers (GPT-2, Llama, Qwen, SmolLM) encode as one token
# each when preceded by a space, so that without a tokenizer a prompt of n words is close
# to n tokens.
FILLER_WORDS: tuple[str, ...] = tuple("""
the of and to in is was for that on with as by at from his her they this had not are but
one all were when we there can an which their said if do will each about how up out them
then she many some so these would other into has more two like him see time could no make
than first been its who now people my made over did down only way find use may water long
little very after words called just where most know get through back much before go good
new write our used me man too any day same right look think also around another came come
work three word must because does part even place well such here take why things help put
years different away again off went old number great tell men say small every found still
between name should home big give air line set own under read last never us left end along
while might next sound below saw something thought both few those always looked show large
often together asked house world going want school important until form food keep children
""".split())


class Tokenizer(Protocol):
    """The slice of a Hugging Face tokenizer that prompt building needs."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt: str
    # Exact with a tokenizer; otherwise the nominal length (one filler word per token).
    # Total input tokens count this length, not the server's usage.prompt_tokens.
    prompt_len: int
    output_len: int
    # The prompt as token ids, for the simulator (a server tokenizes the text itself): the
    # tokenizer's ids, or without one each filler word's index in FILLER_WORDS, so prompts
    # that share words share ids and a simulated prefix cache hits where a real one would.
    prompt_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class TraceRow:
    arrival_s: float
    prompt_len: int
    output_len: int


class PromptBuilder:
    """Builds filler prompts of a target token length from a seeded RNG."""

    def __init__(self, rng: np.random.Generator, tokenizer: Tokenizer | None = None) -> None:
        self._rng = rng
        self._tokenizer = tokenizer

    def build(self, num_tokens: int) -> tuple[str, tuple[int, ...]]:
        """Return (prompt text, its token ids)."""
        words = self._rng.choice(len(FILLER_WORDS), size=num_tokens)
        text = " ".join([FILLER_WORDS[w] for w in words])
        if self._tokenizer is None:
            return text, tuple(words.tolist())
        # Every filler word is at least one token, so truncating the ids hits the target;
        # re-encoding the decoded text measures what the server will actually see.
        ids = self._tokenizer.encode(text, add_special_tokens=False)[:num_tokens]
        text = self._tokenizer.decode(ids)
        return text, self.encode(text, ())

    def encode(self, text: str, nominal: tuple[int, ...]) -> tuple[int, ...]:
        """The text's exact ids with a tokenizer; without one, the ids it was built from."""
        if self._tokenizer is None:
            return nominal
        return tuple(self._tokenizer.encode(text, add_special_tokens=False))


def sample_lengths(mean_len: int, range_ratio: float, num: int,
                   rng: np.random.Generator) -> np.ndarray:
    """Uniform integers in [floor(L*(1-r)), ceil(L*(1+r))], inclusive, at least 1 (vLLM's rule)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    low = max(1, math.floor(mean_len * (1.0 - range_ratio)))
    high = max(low, math.ceil(mean_len * (1.0 + range_ratio)))
    return rng.integers(low, high + 1, size=num)


def make_random_requests(num: int, input_len: int, output_len: int, range_ratio: float,
                         builder: PromptBuilder, rng: np.random.Generator) -> list[BenchRequest]:
    input_lens = sample_lengths(input_len, range_ratio, num, rng)
    output_lens = sample_lengths(output_len, range_ratio, num, rng)
    requests = []
    for n_in, n_out in zip(input_lens, output_lens):
        prompt, ids = builder.build(int(n_in))
        requests.append(BenchRequest(prompt, len(ids), int(n_out), ids))
    return requests


def make_prefix_requests(num: int, prefix_len: int, suffix_len: int, output_len: int,
                         range_ratio: float, builder: PromptBuilder,
                         rng: np.random.Generator, num_prefixes: int = 1) -> list[BenchRequest]:
    """A common prefix (a long system prompt, say) followed by a unique suffix per request;
    with `num_prefixes`, each request starts with one of that many, drawn at random."""
    prefixes = [builder.build(prefix_len) for _ in range(num_prefixes)]
    output_lens = sample_lengths(output_len, range_ratio, num, rng)
    requests = []
    for n_out in output_lens:
        # One prefix draws nothing, so such workloads are the ones the seed always gave.
        prefix, prefix_ids = prefixes[int(rng.integers(num_prefixes)) if num_prefixes > 1 else 0]
        suffix, suffix_ids = builder.build(suffix_len)
        prompt = f"{prefix} {suffix}"
        # Encode the joined text: with a tokenizer a token may merge across the boundary.
        ids = builder.encode(prompt, prefix_ids + suffix_ids)
        requests.append(BenchRequest(prompt, len(ids), int(n_out), ids))
    return requests


def read_trace(path: Path, num: int, rate_scale: float = 1.0,
               max_input_len: int | None = None,
               max_output_len: int | None = None) -> list[TraceRow]:
    """The first `num` rows of the trace, in order, so the real arrival process is kept.

    Arrival times are shifted to start at 0 and divided by `rate_scale` (2.0 replays the
    trace at twice its rate). Lengths are capped, e.g. to fit the model's context. A row that
    is not a request (a length below 1, an arrival that is not a finite number or comes before
    the row above it) is a ValueError naming it: replaying it would time every later request
    from the wrong start, or not at all.
    """
    if not rate_scale > 0:
        raise ValueError(f"rate scale must be > 0, got {rate_scale}")
    for name, cap in (("max input length", max_input_len), ("max output length", max_output_len)):
        if cap is not None and cap < 1:
            raise ValueError(f"{name} must be >= 1 (a cap on a trace's lengths), got {cap}")
    rows: list[TraceRow] = []
    with open(path, newline="") as f:
        for line, record in enumerate(csv.DictReader(f), start=2):  # line 1 is the header
            if len(rows) == num:
                break
            row = _trace_row(record, f"trace {path}, line {line}")
            if rows and row.arrival_s < rows[-1].arrival_s:
                raise ValueError(f"trace {path}, line {line}: arrived_at {row.arrival_s} is before the "
                                 f"row above it ({rows[-1].arrival_s}): a trace must be in arrival order")
            prompt_len, output_len = row.prompt_len, row.output_len
            if max_input_len is not None:
                prompt_len = min(prompt_len, max_input_len)
            if max_output_len is not None:
                output_len = min(output_len, max_output_len)
            rows.append(TraceRow(row.arrival_s, prompt_len, output_len))
    if len(rows) < num:
        raise ValueError(f"trace {path} has {len(rows)} rows, fewer than the {num} requested")
    start = rows[0].arrival_s if rows else 0.0
    return [TraceRow((r.arrival_s - start) / rate_scale, r.prompt_len, r.output_len)
            for r in rows]


def _trace_row(record: dict[str, str | None], where: str) -> TraceRow:
    """One CSV record as a request: arrived_at (seconds), num_prefill_tokens, num_decode_tokens."""
    values = []
    for column in ("arrived_at", "num_prefill_tokens", "num_decode_tokens"):
        text = record.get(column)
        try:
            value = float(text)  # a length may be written "12.0"
        except (TypeError, ValueError):
            raise ValueError(f"{where}: {column} must be a number, got {text!r}") from None
        if not math.isfinite(value):
            raise ValueError(f"{where}: {column} must be finite, got {text!r}")
        values.append(value)
    arrival, prompt_len, output_len = values
    for column, value in (("num_prefill_tokens", prompt_len), ("num_decode_tokens", output_len)):
        if value < 1 or value != int(value):
            raise ValueError(f"{where}: {column} must be a whole number >= 1, got {value:g}")
    return TraceRow(arrival, int(prompt_len), int(output_len))


def rate_step_arrivals(arrivals: list[float], at_index: int, scale_before: float,
                       scale_after: float) -> list[float]:
    """Trace arrival times replayed `scale_before` times as fast up to request `at_index`, and
    `scale_after` times from there on (the gaps keep the trace's shape): a load step."""
    if not (scale_before > 0 and scale_after > 0) or not 0 <= at_index <= len(arrivals):
        raise ValueError(f"rate step needs scales > 0 and an index in [0, {len(arrivals)}], "
                         f"got {scale_before}, {scale_after}, {at_index}")
    out, now, prev = [], 0.0, arrivals[0] if arrivals else 0.0
    for i, t in enumerate(arrivals):
        now += (t - prev) / (scale_before if i < at_index else scale_after)
        prev = t
        out.append(now)
    return out


def make_trace_requests(rows: list[TraceRow], builder: PromptBuilder) -> list[BenchRequest]:
    requests = []
    for row in rows:
        prompt, ids = builder.build(row.prompt_len)
        requests.append(BenchRequest(prompt, len(ids), row.output_len, ids))
    return requests

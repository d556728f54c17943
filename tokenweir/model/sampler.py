"""Token sampling for one step: greedy, temperature, top-k, top-p, min-p, penalties, logit
bias, seeds, logprobs.

Processing order per row: min_tokens mask -> logit bias -> repetition penalty -> frequency
and presence penalties -> temperature -> top-k -> top-p -> min-p -> sample (greedy rows: the
argmax after the penalties, as in vLLM and transformers). Logprobs are those of the raw model
distribution (log-softmax of the logits before any of that processing), as vLLM reports them
by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenweir.model import kernels
from tokenweir.request import GREEDY_TEMPERATURE

# A larger temperature is float32's inf, and -inf (a banned id) / inf is NaN: every row the
# same, so as good as uniform already.
_MAX_TEMPERATURE = torch.finfo(torch.float32).max


@dataclass
class RowGroup:
    """Sampled (non-greedy) rows that share a code path, with their parameters."""

    rows: torch.Tensor  # int64 row indices into the batch
    generators: list[torch.Generator | None]
    top_k: torch.Tensor | None  # int64, 0 = off; None in the group without top-k/top-p
    top_p: torch.Tensor | None  # float32, inf = off


class TokenHistory:
    """A penalised request's token ids (prompt, then output) as a tensor that grows by its
    sampled tokens: the penalties read it every step, and a list turned into a tensor each step
    would cost time in proportion to the whole history."""

    def __init__(self, token_ids: Sequence[int], num_prompt_tokens: int, device: torch.device | str) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self._ids = torch.tensor(list(token_ids) or [0], dtype=torch.int64, device=device)
        self._len = len(token_ids)

    def extend(self, token_ids: Sequence[int]) -> None:
        end = self._len + len(token_ids)
        if end > self._ids.numel():  # doubling: amortised O(1) per token
            grown = torch.empty(max(end, 2 * self._ids.numel()), dtype=torch.int64, device=self._ids.device)
            grown[: self._len] = self._ids[: self._len]
            self._ids = grown
        self._ids[self._len:end] = torch.tensor(list(token_ids), dtype=torch.int64, device=self._ids.device)
        self._len = end

    @property
    def prompt(self) -> torch.Tensor:
        return self._ids[: self.num_prompt_tokens]

    @property
    def output(self) -> torch.Tensor:
        return self._ids[self.num_prompt_tokens: self._len]


def bias_tensors(bias: dict[int, float], device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's logit_bias as (token ids, biases), built once per request."""
    return (torch.tensor(list(bias), dtype=torch.int64, device=device),
            torch.tensor([float(b) for b in bias.values()], dtype=torch.float32, device=device))


@dataclass
class Penalties:
    """Presence, frequency and repetition penalties of a step with at least one penalised row,
    and the tokens those rows saw."""

    presence: torch.Tensor  # float32 [B], 0 = off
    frequency: torch.Tensor  # float32 [B], 0 = off
    repetition: torch.Tensor | None  # float32 [B], 1 = off; None when no row has one
    # (batch row, token) of every output token of the penalised rows, repeated as often as it
    # occurred, and of every prompt token of the rows with a repetition penalty (its tokens
    # are the prompt's and the output's; None without one).
    output: tuple[torch.Tensor, torch.Tensor]
    prompt: tuple[torch.Tensor, torch.Tensor] | None


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters of one step, as tensors built once."""

    temperature: torch.Tensor  # float32 [B]; 1.0 on greedy rows so division stays finite
    greedy: torch.Tensor  # bool [B]
    all_greedy: bool
    # Sampled rows without top-k/top-p need no sort or top-k at all; rows with them are
    # sampled among a few candidates. Splitting keeps a plain row from forcing a full-vocab
    # sort on everyone.
    groups: list[RowGroup]
    min_p: torch.Tensor | None  # float32 [B], 0 = off; None when no row uses min-p
    # (row, token) pairs to mask with -inf: EOS and stop tokens of rows below min_tokens.
    banned: tuple[torch.Tensor, torch.Tensor] | None
    num_logprobs: list[int | None]
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # (rows, tokens, biases)
    penalties: Penalties | None = None

    @classmethod
    def build(
        cls,
        temperature: Sequence[float],
        *,
        top_p: Sequence[float] | None = None,
        top_k: Sequence[int] | None = None,
        min_p: Sequence[float] | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
        min_tokens: Sequence[int] | None = None,
        output_lens: Sequence[int] | None = None,
        stop_token_ids: Sequence[Sequence[int]] | None = None,
        num_logprobs: Sequence[int | None] | None = None,
        presence_penalty: Sequence[float] | None = None,
        frequency_penalty: Sequence[float] | None = None,
        repetition_penalty: Sequence[float] | None = None,
        logit_bias: Sequence[dict[int, float] | tuple[torch.Tensor, torch.Tensor] | None] | None = None,
        prompt_token_ids: Sequence[Sequence[int] | torch.Tensor] | None = None,
        output_token_ids: Sequence[Sequence[int] | torch.Tensor] | None = None,
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        """One entry per row in every list; a list left out means "off" for all rows.

        `stop_token_ids[r]` are the ids (EOS included) that row r may not produce while
        `output_lens[r] < min_tokens[r]`. Seeded rows pass their own `torch.Generator`
        (kept by the caller across steps); None rows use the global RNG. A row with a penalty
        needs its `prompt_token_ids` and `output_token_ids` (others' may be empty), as lists or
        int64 tensors (a `TokenHistory`'s); a row's `logit_bias` is a dict or `bias_tensors`'.
        """
        n = len(temperature)
        greedy = [t < GREEDY_TEMPERATURE for t in temperature]
        ks = [k if k > 0 else 0 for k in top_k] if top_k is not None else [0] * n
        ps = [float("inf") if p >= 1.0 else float(p) for p in top_p] if top_p is not None else [float("inf")] * n
        gens = list(generators) if generators is not None else [None] * n

        groups = []
        plain = [r for r in range(n) if not greedy[r] and ks[r] == 0 and ps[r] == float("inf")]
        filtered = [r for r in range(n) if not greedy[r] and (ks[r] > 0 or ps[r] != float("inf"))]
        if plain:
            groups.append(RowGroup(torch.tensor(plain, device=device), [gens[r] for r in plain], None, None))
        if filtered:
            groups.append(
                RowGroup(
                    torch.tensor(filtered, device=device),
                    [gens[r] for r in filtered],
                    torch.tensor([ks[r] for r in filtered], dtype=torch.int64, device=device),
                    torch.tensor([ps[r] for r in filtered], dtype=torch.float32, device=device),
                )
            )

        banned = None
        if min_tokens is not None:
            if output_lens is None or stop_token_ids is None:
                raise ValueError("min_tokens needs output_lens and stop_token_ids")
            rows: list[int] = []
            cols: list[int] = []
            for r, (need, have, ids) in enumerate(zip(min_tokens, output_lens, stop_token_ids)):
                if have < need:
                    rows += [r] * len(ids)
                    cols += list(ids)
            if rows:
                banned = (torch.tensor(rows, device=device), torch.tensor(cols, device=device))

        bias = None
        biased = [] if logit_bias is None else [(r, b) for r, b in enumerate(logit_bias) if b is not None and len(b)]
        if biased:
            parts = [bias_tensors(b, device) if isinstance(b, dict) else b for _, b in biased]
            bias = (torch.cat([torch.full_like(tokens, r) for (r, _), (tokens, _) in zip(biased, parts)]),
                    torch.cat([tokens for tokens, _ in parts]), torch.cat([values for _, values in parts]))

        return cls(
            logit_bias=bias,
            penalties=_penalties(presence_penalty, frequency_penalty, repetition_penalty, prompt_token_ids,
                                 output_token_ids, n, device),
            temperature=torch.tensor([1.0 if g else min(float(t), _MAX_TEMPERATURE) for g, t in zip(greedy, temperature)],
                                     device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            groups=groups,
            min_p=torch.tensor(min_p, dtype=torch.float32, device=device) if min_p and any(min_p) else None,
            banned=banned,
            num_logprobs=list(num_logprobs) if num_logprobs is not None else [None] * n,
        )


def _penalties(presence: Sequence[float] | None, frequency: Sequence[float] | None,
               repetition: Sequence[float] | None, prompts: Sequence[Sequence[int]] | None,
               outputs: Sequence[Sequence[int]] | None, n: int, device: torch.device | str) -> Penalties | None:
    presence = list(presence) if presence is not None else [0.0] * n
    frequency = list(frequency) if frequency is not None else [0.0] * n
    repetition = list(repetition) if repetition is not None else [1.0] * n
    penalised = [r for r in range(n) if presence[r] or frequency[r] or repetition[r] != 1.0]
    if not penalised:
        return None
    if prompts is None or outputs is None:
        raise ValueError("penalties need prompt_token_ids and output_token_ids")
    repeating = [r for r in penalised if repetition[r] != 1.0]

    def pairs(ids: Sequence[Sequence[int] | torch.Tensor], rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = [torch.as_tensor(ids[r], dtype=torch.int64, device=device) for r in rows]
        return torch.cat([torch.full_like(t, r) for r, t in zip(rows, tokens)]), torch.cat(tokens)

    def column(values: list[float]) -> torch.Tensor:
        return torch.tensor([float(v) for v in values], dtype=torch.float32, device=device)

    return Penalties(column(presence), column(frequency), column(repetition) if repeating else None,
                     pairs(outputs, penalised), pairs(prompts, repeating) if repeating else None)


def _penalize(logits: torch.Tensor, pen: Penalties) -> torch.Tensor:
    """The logits (float32) after the repetition, frequency and presence penalties. Only the
    entries of tokens a row saw are read and written (a history is far shorter than the
    vocabulary, and most rows of a batch have none)."""
    vocab = logits.shape[-1]
    logits = logits.clone()
    flat = logits.view(-1)
    output = pen.output[0] * vocab + pen.output[1]  # entries of the flat logits
    if pen.repetition is not None and pen.prompt is not None:
        seen = torch.unique(torch.cat([pen.prompt[0] * vocab + pen.prompt[1], output]))
        values, factor = flat[seen], pen.repetition[seen // vocab]
        flat[seen] = torch.where(values > 0, values / factor, values * factor)
    entries, counts = torch.unique(output, return_counts=True)
    if entries.numel():
        rows = entries // vocab
        flat[entries] -= pen.frequency[rows] * counts + pen.presence[rows]
    return logits


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # raw-model logprob of each sampled token, when asked for
    top_logprobs: list[list[tuple[int, float]] | None]  # (token, logprob), best first


class Sampler:
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits [B, V] (any float dtype) -> one token per row."""
        wants_logprobs = any(n is not None for n in meta.num_logprobs)
        changed = meta.logit_bias is not None or meta.penalties is not None
        if not meta.all_greedy or wants_logprobs or changed:
            logits = logits.float()  # probabilities and penalties in float32; argmax alone needs no widening
        raw_logprobs = logits.log_softmax(dim=-1) if wants_logprobs else None
        if meta.banned is not None:
            # In the logits' own dtype: all-greedy steps keep bf16 logits.
            minus_inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
            logits = logits.index_put(meta.banned, minus_inf)
        if meta.logit_bias is not None:
            rows, tokens, biases = meta.logit_bias
            logits = logits.index_put((rows, tokens), biases, accumulate=True)
        if meta.penalties is not None:
            logits = _penalize(logits, meta.penalties)

        # Right for greedy rows; sampled rows are overwritten below.
        tokens = kernels.argmax_rows(logits) if kernels.fused_ops_available(logits) else logits.argmax(dim=-1)
        if not meta.all_greedy:
            for group in meta.groups:
                scaled = logits[group.rows] / meta.temperature[group.rows, None]
                probs, vocab_ids = _filter(scaled, group)
                if meta.min_p is not None:
                    min_p = meta.min_p[group.rows, None]
                    probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
                picked = _draw(probs, group.generators)
                if vocab_ids is not None:
                    picked = vocab_ids.gather(1, picked[:, None]).squeeze(1)
                tokens[group.rows] = picked

        return SamplerOutput(token_ids=tokens.tolist(), **_logprobs(raw_logprobs, tokens, meta.num_logprobs))


# Top-p first looks among this many best tokens; when a row's nucleus may not lie among them
# (a very flat distribution), the whole vocabulary is sorted instead. A full sort of 32 x 49k
# logits is several times slower than taking the candidates.
_TOP_P_CANDIDATES = 1024


def _filter(scaled: torch.Tensor, group: RowGroup) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Temperature-scaled logits -> (probabilities, vocab id of each column or None = identity).

    Top-p keeps each row's nucleus: the shortest run of best tokens whose probability under the
    top-k-filtered distribution (the whole vocabulary without top-k) reaches top_p. A token is
    in when the tokens before it hold less than top_p, so the best token always is (as vLLM).
    """
    if group.top_k is None or group.top_p is None:
        return scaled.softmax(dim=-1), None
    vocab = scaled.shape[-1]
    k = torch.where(group.top_k > 0, group.top_k, vocab).clamp_(max=vocab)
    use_top_p = bool(torch.isfinite(group.top_p).any())
    width = min(vocab, int(k.max()), _TOP_P_CANDIDATES if use_top_p else vocab)
    values, ids = _best(scaled, width)
    values = _mask_beyond_top_k(values, k)
    if not use_top_p:
        return values.softmax(dim=-1), ids
    # Probabilities as shares of each row's whole top-k set, not of the candidates: normalising
    # over the candidates would cut the nucleus short whenever they hold less than all the mass.
    log_mass = values.logsumexp(dim=-1)  # the top-k set's mass where the candidates hold it
    if width < vocab:
        log_mass = torch.where(k == vocab, scaled.logsumexp(dim=-1), log_mass)
    probs = (values - log_mass[:, None]).exp()
    cumulative = probs.cumsum(dim=-1)
    # The candidates hold a row's nucleus if they hold its whole top-k set, or (without top-k)
    # at least top_p of its mass. A top-k set larger than the candidates has an unknown mass.
    if width < vocab and not bool(((k <= width) | ((k == vocab) & (cumulative[:, -1] >= group.top_p))).all()):
        values, ids = _best(scaled, vocab)
        values = _mask_beyond_top_k(values, k)
        probs = values.softmax(dim=-1)
        cumulative = probs.cumsum(dim=-1)
    outside = (cumulative - probs) >= group.top_p[:, None]
    outside[:, 0] = False  # the best token is always in (a top_p that float32 rounds to 0)
    return values.masked_fill(outside, float("-inf")).softmax(dim=-1), ids


def _best(scaled: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's `width` best columns, best first, tied values in ascending id order: which
    tied tokens are kept, and in which order the draw reads them, must not depend on `width`
    (set by the other rows of the group) or on a sort's whim. bf16 logits tie often."""
    vocab = scaled.shape[-1]
    if width == vocab:
        return tuple(scaled.sort(dim=-1, descending=True, stable=True))  # ties stay in id order
    values, ids = scaled.topk(width, dim=-1)
    # topk takes any of the tokens tied with its last value: where it left some out, keep the
    # lowest ids among them instead (a row or two when it happens; none for distinct logits).
    last = values[:, -1:]
    for r in ((scaled >= last).sum(dim=-1) > width).nonzero().squeeze(1).tolist():
        above = ids[r][values[r] > last[r]]
        tied = (scaled[r] == last[r]).nonzero().squeeze(1)[: width - above.numel()]
        ids[r] = torch.cat([above, tied])
        values[r] = scaled[r, ids[r]]
    # Best first, ties by ascending id: a stable sort by value of the candidates in id order.
    ids, by_id = ids.sort(dim=-1)
    values, order = values.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    return values, ids.gather(1, order)


def _mask_beyond_top_k(values: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """-inf from each row's k-th column on (`values` sorted best first)."""
    ranks = torch.arange(values.shape[-1], device=values.device)
    return values.masked_fill(ranks[None, :] >= k[:, None], float("-inf"))


def advance_generator(generator: torch.Generator, num_draws: int) -> None:
    """Move a seeded row's generator past `num_draws` of `_draw`'s draws (one per sampled token),
    drawn exactly as `_draw` draws them."""
    for _ in range(num_draws):
        torch.rand(1, generator=generator, device=generator.device)


def _draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One column per row, with probability proportional to `probs` (inverse CDF).

    One uniform number per row: unseeded rows share the global RNG, a seeded row draws from
    its own generator only, so the random numbers it uses do not depend on what else is in the
    batch. Its tokens can: the logits of a row differ in the last bits between batch shapes
    (another matmul blocking), which moves a draw that falls that close to a CDF boundary.
    (torch.multinomial draws one exponential per vocabulary entry: ~25 ms for 32 x 49k here.)
    """
    u = torch.rand(probs.shape[0], device=probs.device)
    for row, gen in enumerate(generators):
        if gen is not None:
            u[row] = torch.rand(1, generator=gen, device=gen.device)[0]
    cdf = probs.cumsum(dim=-1)
    # The first column whose cumulative mass exceeds the target: never a zero-probability one.
    picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
    return picked.clamp_(max=probs.shape[-1] - 1)


def _logprobs(raw: torch.Tensor | None, tokens: torch.Tensor, wanted: list[int | None]) -> dict[str, list]:
    n = len(wanted)
    if raw is None:
        return {"logprobs": [None] * n, "top_logprobs": [None] * n}
    chosen = raw.gather(1, tokens[:, None]).squeeze(1).tolist()
    most = min(max(k for k in wanted if k is not None), raw.shape[-1])  # a vocabulary smaller than 20
    top = raw.topk(most, dim=-1)
    top_vals, top_ids = top.values.tolist(), top.indices.tolist()
    logprobs: list[float | None] = []
    pairs: list[list[tuple[int, float]] | None] = []
    for r, k in enumerate(wanted):
        logprobs.append(None if k is None else chosen[r])
        pairs.append(None if k is None else list(zip(top_ids[r][:k], top_vals[r][:k])))
    return {"logprobs": logprobs, "top_logprobs": pairs}

"""Token sampling for one step: greedy, temperature, top-k, top-p, min-p, seeds, logprobs.

Processing order per row: min_tokens mask -> temperature -> top-k -> top-p -> min-p -> sample.
Logprobs are those of the raw model distribution (log-softmax of the logits before any of
that processing), as vLLM reports them by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Temperatures below this are treated as greedy (dividing by them would overflow).
_GREEDY_TEMPERATURE = 1e-5


@dataclass
class SamplingMetadata:
    """Per-row sampling parameters of one step, as tensors built once."""

    temperature: torch.Tensor  # float32 [B]; 1.0 on greedy rows so division stays finite
    greedy: torch.Tensor  # bool [B]
    all_greedy: bool
    top_k: torch.Tensor | None  # int64 [B], 0 = off; None when no row uses top-k
    top_p: torch.Tensor | None  # float32 [B], inf = off; None when no row uses top-p
    min_p: torch.Tensor | None  # float32 [B], 0 = off; None when no row uses min-p
    generators: list[torch.Generator | None]
    # (row, token) pairs to mask with -inf: EOS and stop tokens of rows below min_tokens.
    banned: tuple[torch.Tensor, torch.Tensor] | None
    num_logprobs: list[int | None]

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
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        """One entry per row in every list; a list left out means "off" for all rows.

        `stop_token_ids[r]` are the ids (EOS included) that row r may not produce while
        `output_lens[r] < min_tokens[r]`.
        """
        n = len(temperature)
        greedy = [t < _GREEDY_TEMPERATURE for t in temperature]
        temps = [1.0 if g else float(t) for g, t in zip(greedy, temperature)]
        ks = [k if k > 0 else 0 for k in top_k] if top_k is not None else []
        ps = [float("inf") if p >= 1.0 else float(p) for p in top_p] if top_p is not None else []
        mps = [float(p) for p in min_p] if min_p is not None else []

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

        def tensor_if_used(values: list[float] | list[int], off: float, dtype: torch.dtype) -> torch.Tensor | None:
            if not any(v != off for v in values):
                return None
            return torch.tensor(values, dtype=dtype, device=device)

        return cls(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            all_greedy=all(greedy),
            top_k=tensor_if_used(ks, 0, torch.int64),
            top_p=tensor_if_used(ps, float("inf"), torch.float32),
            min_p=tensor_if_used(mps, 0.0, torch.float32),
            generators=list(generators) if generators is not None else [None] * n,
            banned=banned,
            num_logprobs=list(num_logprobs) if num_logprobs is not None else [None] * n,
        )


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # raw-model logprob of each sampled token, when asked for
    top_logprobs: list[list[tuple[int, float]] | None]  # (token, logprob), best first


class Sampler:
    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: float32 [B, V] -> one token per row."""
        raw_logprobs = logits.log_softmax(dim=-1) if any(n is not None for n in meta.num_logprobs) else None
        if meta.banned is not None:
            logits = logits.index_put(meta.banned, torch.tensor(float("-inf"), device=logits.device))

        if meta.all_greedy:
            tokens = logits.argmax(dim=-1)
        else:
            sampled = _sample(_filter(logits / meta.temperature[:, None], meta), meta.generators)
            tokens = torch.where(meta.greedy, logits.argmax(dim=-1), sampled) if meta.greedy.any() else sampled

        token_list = tokens.tolist()
        return SamplerOutput(token_ids=token_list, **_logprobs(raw_logprobs, tokens, meta.num_logprobs))


def _filter(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Temperature-scaled logits -> probabilities after top-k, top-p and min-p."""
    if meta.top_k is not None or meta.top_p is not None:
        # One descending sort serves both: top-k keeps the first k ranks, top-p the shortest
        # prefix whose mass reaches p (the best token always survives).
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[-1], device=logits.device)
        remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if meta.top_k is not None:
            k = torch.where(meta.top_k > 0, meta.top_k, logits.shape[-1])
            remove |= ranks[None, :] >= k[:, None]
            sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        if meta.top_p is not None:
            probs = sorted_logits.softmax(dim=-1)
            remove |= (probs.cumsum(dim=-1) - probs) > meta.top_p[:, None]
            sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    probs = logits.softmax(dim=-1)
    if meta.min_p is not None:
        threshold = meta.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs


def _sample(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    # Unseeded rows share the global RNG in one call; a seeded row draws from its own
    # generator only, so its tokens do not depend on what else is in the batch.
    seeded = [(row, gen) for row, gen in enumerate(generators) if gen is not None]
    if len(seeded) < len(generators):
        tokens = torch.multinomial(probs, 1).squeeze(1)
    else:
        tokens = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
    for row, gen in seeded:
        tokens[row] = torch.multinomial(probs[row], 1, generator=gen)[0]
    return tokens


def _logprobs(
    raw: torch.Tensor | None, tokens: torch.Tensor, wanted: list[int | None]
) -> dict[str, list]:
    n = len(wanted)
    if raw is None:
        return {"logprobs": [None] * n, "top_logprobs": [None] * n}
    chosen = raw.gather(1, tokens[:, None]).squeeze(1).tolist()
    most = max(k for k in wanted if k is not None)
    top = raw.topk(most, dim=-1)
    top_vals, top_ids = top.values.tolist(), top.indices.tolist()
    logprobs: list[float | None] = []
    pairs: list[list[tuple[int, float]] | None] = []
    for r, k in enumerate(wanted):
        logprobs.append(None if k is None else chosen[r])
        pairs.append(None if k is None else list(zip(top_ids[r][:k], top_vals[r][:k])))
    return {"logprobs": logprobs, "top_logprobs": pairs}

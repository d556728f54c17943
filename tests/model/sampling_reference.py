"""An exact sampler to test tokenweir's against: the definitions over a full sort in float64.

Processing order as the sampler's: temperature -> top-k -> top-p -> min-p, then one uniform
number per draw from the row's generator, inverted through the CDF over the sampler's columns:
the tokens best first in a row with top-k or top-p, in vocabulary order in a row without.
"""

from __future__ import annotations

import torch


def reference_distribution(
    x: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [V] -> (vocab ids best first, their final probabilities)."""
    values, order = (x.double() / temperature).sort(descending=True, stable=True)
    if top_k > 0:
        values[top_k:] = float("-inf")
    probs = values.softmax(-1)
    # The nucleus: the shortest prefix whose mass reaches top_p (the tokens before a kept one
    # hold less than top_p).
    probs = torch.where(probs.cumsum(-1) - probs < top_p, probs, 0.0)
    probs = torch.where(probs >= min_p * probs.max(), probs, 0.0)
    return order, probs / probs.sum()


def reference_tokens(x: torch.Tensor, seed: int, steps: int, *, best_first: bool = True, **params: float) -> list[int]:
    """The tokens an exact sampler draws in `steps` steps from a generator seeded with `seed`."""
    order, probs = reference_distribution(x, **params)
    if not best_first:
        probs = torch.zeros_like(probs).scatter_(0, order, probs)
        order = torch.arange(len(order))
    cdf = probs.cumsum(-1)
    gen = torch.Generator().manual_seed(seed)
    u = torch.cat([torch.rand(1, generator=gen) for _ in range(steps)]).double() * cdf[-1]
    picks = torch.searchsorted(cdf, u, right=True).clamp_(max=len(cdf) - 1)
    return order[picks].tolist()

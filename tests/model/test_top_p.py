"""Top-p against an exact reference (tests/model/sampling_reference.py) on a vocabulary of the default
model's size, with nuclei inside, at the edge of, and beyond the sampler's 1,024 candidates."""

from __future__ import annotations

import pytest
import torch

import tokenweir.model.sampler as sampler_mod
from tests.model.sampling_reference import reference_distribution as reference, reference_tokens
from tokenweir.model.sampler import Sampler, SamplingMetadata

VOCAB = 49152
CANDIDATES = sampler_mod._TOP_P_CANDIDATES


def shaped_logits(head_mass: float, decay: float = 2e-4, seed: int = 0) -> torch.Tensor:
    """1,024 likely tokens holding `head_mass` (gently decaying), the rest nearly uniform,
    shuffled over the vocabulary. With head_mass 0.927 this is the reported shape: the nucleus
    for p=0.9 has 991 tokens, and normalising over the candidates kept 912 (mass 0.835)."""
    g = torch.Generator().manual_seed(seed)
    head = torch.exp(-decay * torch.arange(CANDIDATES, dtype=torch.float64))
    head = head / head.sum() * head_mass
    tail = torch.full((VOCAB - CANDIDATES,), (1 - head_mass) / (VOCAB - CANDIDATES), dtype=torch.float64)
    x = torch.cat([head, tail]).log() + 0.01 * torch.randn(VOCAB, generator=g, dtype=torch.float64)
    return x[torch.randperm(VOCAB, generator=g)].float()


def nucleus_size(x: torch.Tensor, top_p: float) -> int:
    return int((reference(x, top_p=top_p)[1] > 0).sum())


def filtered(rows: list[torch.Tensor], **params: list) -> torch.Tensor:
    """The sampler's distribution after temperature, top-k and top-p, in vocabulary order."""
    x = torch.stack(rows)
    meta = SamplingMetadata.build(**params)
    (group,) = meta.groups
    probs, ids = sampler_mod._filter(x[group.rows] / meta.temperature[group.rows, None], group)
    return torch.zeros(x.shape, dtype=torch.float64).scatter_(1, ids, probs.double())


def in_vocab_order(order: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    return torch.zeros(VOCAB, dtype=torch.float64).scatter_(0, order, probs)


def cumulative_mass(x: torch.Tensor) -> torch.Tensor:
    probs = x.double().softmax(-1).sort(descending=True).values
    return probs.cumsum(-1)


REPORTED = shaped_logits(0.927)
FLAT = -torch.arange(VOCAB, dtype=torch.float32)[torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))] * 1e-4
_CUM = cumulative_mass(REPORTED)
# p between the mass of the best 1,023 and 1,024 tokens: the nucleus is exactly the candidates;
# one token further: the nucleus is one token beyond them.
P_EDGE_IN = float(_CUM[CANDIDATES - 2] + _CUM[CANDIDATES - 1]) / 2
P_EDGE_OUT = float(_CUM[CANDIDATES - 1] + _CUM[CANDIDATES]) / 2

CASES = {
    # name: (logits, temperature, top_k, top_p, expected nucleus size or None)
    "reported, inside": (REPORTED, 1.0, 0, 0.9, 991),
    "exactly the candidates": (REPORTED, 1.0, 0, P_EDGE_IN, CANDIDATES),
    "one beyond the candidates": (REPORTED, 1.0, 0, P_EDGE_OUT, CANDIDATES + 1),
    "flat, far beyond": (FLAT, 1.0, 0, 0.9, None),
    "temperature": (REPORTED, 0.5, 0, 0.8, None),
    "top-k inside the candidates": (REPORTED, 1.3, 700, 0.9, None),
    "top-k beyond the candidates": (FLAT, 0.9, 3000, 0.6, None),
}


@pytest.mark.parametrize("name", CASES)
def test_top_p_keeps_exactly_the_nucleus(name):
    x, temperature, top_k, top_p, size = CASES[name]
    order, want = reference(x, temperature, top_k, top_p)
    if size is not None:
        assert int((want > 0).sum()) == size  # the case has the shape its name says
    got = filtered([x], temperature=[temperature], top_k=[top_k], top_p=[top_p])[0]
    want = in_vocab_order(order, want)
    assert torch.equal(got > 0, want > 0), f"kept {int((got > 0).sum())} tokens, the nucleus has {int((want > 0).sum())}"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-9)


def test_rows_of_one_batch_each_keep_their_own_nucleus():
    # The flat row sends the whole batch to the full sort; the others must come out the same.
    names = list(CASES)
    got = filtered([CASES[n][0] for n in names], temperature=[CASES[n][1] for n in names],
                   top_k=[CASES[n][2] for n in names], top_p=[CASES[n][3] for n in names])
    for row, name in enumerate(names):
        x, temperature, top_k, top_p, _ = CASES[name]
        want = in_vocab_order(*reference(x, temperature, top_k, top_p))
        assert torch.equal(got[row] > 0, want > 0), name


def test_reported_shape_is_cut_at_the_whole_distributions_mass():
    assert nucleus_size(REPORTED, 0.9) == 991
    assert float(_CUM[CANDIDATES - 1]) == pytest.approx(0.927, abs=1e-4)  # candidates reach p, not 1
    kept = filtered([REPORTED], temperature=[1.0], top_p=[0.9])[0] > 0
    assert float(REPORTED.double().softmax(-1)[kept].sum()) >= 0.9


# Seeded rows through the whole sampler (temperature, top-k, top-p, min-p): the tokens drawn
# must be those an exact sampler draws with the same uniform numbers.
ROWS = [
    dict(x=REPORTED, temperature=1.0, top_k=0, top_p=0.9, min_p=0.0),
    dict(x=REPORTED, temperature=0.7, top_k=0, top_p=0.9, min_p=0.8),
    dict(x=REPORTED, temperature=1.2, top_k=800, top_p=0.95, min_p=0.0),
    dict(x=shaped_logits(0.95, seed=3), temperature=1.0, top_k=0, top_p=0.93, min_p=0.85),
]


@pytest.mark.parametrize("with_flat_row", [False, True], ids=["candidates", "full sort"])
def test_seeded_tokens_match_an_exact_sampler(with_flat_row):
    rows = ROWS + ([dict(x=FLAT, temperature=1.0, top_k=0, top_p=0.9, min_p=0.0)] if with_flat_row else [])
    steps = 40
    gens = [torch.Generator().manual_seed(100 + r) for r in range(len(rows))]
    meta = SamplingMetadata.build(
        [r["temperature"] for r in rows], top_k=[r["top_k"] for r in rows], top_p=[r["top_p"] for r in rows],
        min_p=[r["min_p"] for r in rows], generators=gens,
    )
    x = torch.stack([r["x"] for r in rows])
    drawn = [Sampler()(x, meta).token_ids for _ in range(steps)]
    for r, row in enumerate(rows):
        params = {k: v for k, v in row.items() if k != "x"}
        assert [step[r] for step in drawn] == reference_tokens(row["x"], 100 + r, steps, **params), f"row {r}"


def test_min_p_in_these_rows_removes_tokens_the_nucleus_keeps():
    # So that the seeded test above also checks min-p, not only top-p.
    for row in (ROWS[1], ROWS[3]):
        with_min_p = reference(row["x"], row["temperature"], row["top_k"], row["top_p"], row["min_p"])[1]
        without = reference(row["x"], row["temperature"], row["top_k"], row["top_p"])[1]
        assert (with_min_p > 0).sum() < (without > 0).sum()

from __future__ import annotations

import math

import pytest
import torch

from tests.model.sampling_reference import reference_tokens
from tokenweir.model.sampler import Sampler, SamplingMetadata

V = 50


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * 3


def sample(x: torch.Tensor, **kw):
    return Sampler()(x, SamplingMetadata.build(**kw))


def test_greedy_is_argmax_with_lowest_index_on_ties():
    x = logits(4)
    x[3, 7] = x[3, 9] = x[3].max() + 1
    out = sample(x, temperature=[0.0] * 4)
    assert out.token_ids == x.argmax(-1).tolist()
    assert out.token_ids[3] == 7
    assert out.logprobs == [None] * 4 and out.top_logprobs == [None] * 4


def test_top_k_one_equals_greedy():
    x = logits(8, seed=1)
    out = sample(x, temperature=[1.5] * 8, top_k=[1] * 8)
    assert out.token_ids == x.argmax(-1).tolist()


def test_mixed_greedy_and_sampled_rows():
    x = logits(3, seed=2)
    out = sample(x, temperature=[0.0, 1.0, 0.0], top_k=[0, 1, -1])
    assert out.token_ids == x.argmax(-1).tolist()


def test_seeded_rows_reproducible_and_batch_independent():
    x = logits(6, seed=3)

    def run(rows: list[int], seed_row: int) -> int:
        gens = [torch.Generator().manual_seed(1234) if r == seed_row else None for r in rows]
        out = sample(x[rows], temperature=[1.0] * len(rows), top_p=[0.9] * len(rows), generators=gens)
        return out.token_ids[rows.index(seed_row)]

    alone = [run([0], 0) for _ in range(3)]
    assert alone == reference_tokens(x[0], seed=1234, steps=1, top_p=0.9) * 3
    torch.manual_seed(99)  # the global RNG state must not matter either
    assert run([3, 0, 5], 0) == alone[0]
    assert run([0, 1, 2, 4], 0) == alone[0]
    # A sequence of steps: the generator's state advances, identically in both runs.
    for rows in ([0], [2, 0]):
        g = torch.Generator().manual_seed(7)
        seq = []
        for _ in range(5):
            gens = [g if r == 0 else None for r in rows]
            seq.append(sample(x[rows], temperature=[1.0] * len(rows), generators=gens).token_ids[rows.index(0)])
        assert seq == reference_tokens(x[0], seed=7, steps=5, best_first=False), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_min_tokens_masks_eos_and_stop_ids(dtype):
    # All rows greedy: bf16 logits stay bf16 (nothing widens them), and the mask must fit that.
    x = torch.zeros(3, V, dtype=dtype)
    x[:, 2] = 10.0  # EOS is everyone's favourite
    x[:, 5] = 9.0  # then a stop token
    out = sample(
        x,
        temperature=[0.0, 0.0, 0.0],
        min_tokens=[4, 4, 0],
        output_lens=[3, 4, 0],
        stop_token_ids=[[2, 5], [2, 5], [2]],
    )
    # Row 0 may take neither 2 nor 5: the rest tie at 0, and greedy takes the lowest index.
    assert out.token_ids == [0, 2, 2]


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    x = probs.log()
    seen = set()
    for _ in range(300):
        seen.update(sample(x, temperature=[1.0], top_p=[0.7]).token_ids)
    assert seen == {0, 1}


def test_min_p_removes_unlikely_tokens():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    x = probs.log()
    seen = set()
    for _ in range(300):
        seen.update(sample(x, temperature=[1.0], min_p=[0.25]).token_ids)
    assert seen == {0, 1, 2}  # 0.05 < 0.25 * 0.5


def test_top_k_with_temperature_samples_only_top_tokens():
    x = logits(1, seed=4)
    top3 = set(x[0].topk(3).indices.tolist())
    seen = set()
    for _ in range(200):
        seen.update(sample(x, temperature=[5.0], top_k=[3]).token_ids)
    assert seen == top3


def test_sampling_follows_the_distribution():
    # Each draw inverts one uniform number of the row's generator through the CDF: exactly the
    # tokens an exact sampler draws from the same numbers, hence also its frequencies.
    x = torch.tensor([[0.6, 0.3, 0.1]]).log()
    gen = torch.Generator().manual_seed(0)
    meta = SamplingMetadata.build([1.0], generators=[gen])
    drawn = [Sampler()(x, meta).token_ids[0] for _ in range(2000)]
    assert drawn == reference_tokens(x[0], seed=0, steps=2000, best_first=False)
    assert abs(drawn.count(0) / 2000 - 0.6) < 0.05 and abs(drawn.count(2) / 2000 - 0.1) < 0.03


def test_logprobs_are_raw_log_softmax():
    x = logits(3, seed=5)
    out = sample(x, temperature=[0.0, 2.0, 0.7], top_k=[0, 5, 0], num_logprobs=[3, 0, None])
    ref = x.log_softmax(-1)
    assert out.logprobs[0] == pytest.approx(ref[0, out.token_ids[0]].item(), abs=1e-6)
    assert out.logprobs[1] == pytest.approx(ref[1, out.token_ids[1]].item(), abs=1e-6)
    assert out.logprobs[2] is None and out.top_logprobs[2] is None
    assert out.top_logprobs[1] == []
    top = ref[0].topk(3)
    assert [t for t, _ in out.top_logprobs[0]] == top.indices.tolist()
    assert all(math.isclose(lp, r, abs_tol=1e-6) for (_, lp), r in zip(out.top_logprobs[0], top.values.tolist()))


def test_all_greedy_skips_probability_work(monkeypatch):
    import tokenweir.model.sampler as sampler_mod

    def boom(*a, **k):
        raise AssertionError("an all-greedy batch must not filter or sample")

    monkeypatch.setattr(sampler_mod, "_filter", boom)
    monkeypatch.setattr(sampler_mod, "_draw", boom)
    x = logits(2)
    assert sample(x, temperature=[0.0, 0.0], top_p=[0.5, 0.5]).token_ids == x.argmax(-1).tolist()


def test_top_k_then_top_p():
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1]])
    seen = set()
    for _ in range(300):
        # top-k 3 renormalises to 0.44, 0.33, 0.22: the 0.5 nucleus is the first two
        seen.update(sample(probs.log(), temperature=[1.0], top_k=[3], top_p=[0.5]).token_ids)
    assert seen == {0, 1}


def test_plain_and_filtered_rows_in_one_batch():
    x = logits(4, seed=6)
    gens = [torch.Generator().manual_seed(s) for s in (1, 0, 0, 0)]
    meta = SamplingMetadata.build([1.0, 0.0, 1.0, 1.0], top_k=[0, 0, 1, 0], min_p=[0.0, 0.0, 0.0, 1.0],
                                  generators=gens)
    out = Sampler()(x, meta)
    best = x.argmax(-1).tolist()
    assert out.token_ids[1:] == best[1:]  # greedy, top-k 1, and min-p 1 all take the best token
    # The plain row samples from its whole distribution, unaffected by its neighbours' filters.
    assert out.token_ids[0] == reference_tokens(x[0], seed=1, steps=1, best_first=False)[0] != best[0]


@pytest.mark.parametrize("params", [dict(top_k=8), dict(top_p=0.5), dict(top_k=8, top_p=0.7)])
def test_tied_logits_give_a_seeded_row_the_same_token_whatever_its_batch_mates(params):
    # bf16 logits tie often. Which tied tokens are kept and in which order the draw reads them
    # must follow the exact sampler (ties by ascending id), not the width the group's other
    # rows set (a top_k=40 mate) nor the full sort a flat top_p mate forces.
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(1, 4000, generator=g) * 2).round() / 2  # few distinct values: ties everywhere
    mates = {"top_k": [40], "top_p": [0.999]}
    for seed in range(40):
        want = reference_tokens(x[0], seed=seed, steps=1, **params)
        rows = {name: [value, *mates[name]] for name, value in params.items()}
        for batch, kw in ((x, {k: [v] for k, v in params.items()}), (x.repeat(2, 1), rows)):
            gens = [torch.Generator().manual_seed(seed)] + [None] * (batch.shape[0] - 1)
            token = sample(batch, temperature=[1.0] * batch.shape[0], generators=gens, **kw).token_ids[0]
            assert token == want[0], (seed, params, batch.shape[0])


def test_parameters_at_the_edge_of_float32_still_sample_the_right_set():
    x = logits(4, seed=11)
    # top_p that float32 rounds to 0 keeps the best token, as a tiny one does.
    assert sample(x, temperature=[1.0] * 4, top_p=[1e-46] * 4).token_ids == x.argmax(-1).tolist()
    # A temperature past float32's range with a banned id: never the banned one (-inf / inf was NaN).
    out = sample(x, temperature=[1e39] * 4, min_tokens=[5] * 4, output_lens=[0] * 4,
                 stop_token_ids=[[V - 1]] * 4)
    assert V - 1 not in out.token_ids
    # Logprobs of more tokens than the vocabulary has: all of them.
    small = logits(2, seed=12)[:, :5]
    out = sample(small, temperature=[0.0, 1.0], num_logprobs=[20, None])
    assert len(out.top_logprobs[0]) == 5 and out.top_logprobs[1] is None

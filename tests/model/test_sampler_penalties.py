"""The sampler's penalties and logit bias on crafted logits, against transformers' own logits
processors (RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor) and OpenAI's
documented presence/frequency formula: greedy picks the processed logits' argmax, so rows whose
logits are all negative, or nearly tied, show each branch of the formulas."""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.test_penalties import OpenAIPenalties
from tokenweir.model.sampler import Sampler, SamplingMetadata

VOCAB = 40


def reference_argmax(logits: torch.Tensor, prompt: list[int], output: list[int], presence: float,
                     frequency: float, repetition: float, bias: dict[int, float]) -> int:
    from transformers import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

    ids = torch.tensor([prompt + output])
    scores = logits[None].clone()
    if bias:
        scores = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})(ids, scores)
    if repetition != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(repetition)(ids, scores)
    scores = OpenAIPenalties(len(prompt), presence, frequency)(ids, scores)
    return int(scores.argmax())


@pytest.mark.parametrize("sign", ["negative", "mixed"])
def test_greedy_penalised_rows_pick_the_references_argmax(sign):
    rng = random.Random(3)
    torch.manual_seed(3)
    rows = []
    for _ in range(64):
        logits = -torch.rand(VOCAB) * 4 if sign == "negative" else torch.randn(VOCAB)
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 8))]
        # Outputs that repeat the best tokens, so the penalties decide.
        best = logits.topk(4).indices.tolist()
        output = [rng.choice(best) for _ in range(rng.randrange(0, 6))]
        rows.append((logits, prompt, output, rng.choice([0.0, 0.8, -0.4]), rng.choice([0.0, 0.5, 1.5]),
                     rng.choice([1.0, 1.7, 0.5]), rng.choice([{}, {best[0]: -3.0}, {best[-1]: 1.2, 0: 0.5}])))
    logits = torch.stack([r[0] for r in rows])
    meta = SamplingMetadata.build(
        [0.0] * len(rows), presence_penalty=[r[3] for r in rows], frequency_penalty=[r[4] for r in rows],
        repetition_penalty=[r[5] for r in rows], logit_bias=[r[6] for r in rows],
        prompt_token_ids=[r[1] for r in rows], output_token_ids=[r[2] for r in rows])
    got = Sampler()(logits, meta).token_ids
    want = [reference_argmax(*r) for r in rows]
    assert got == want
    # The rows' own argmax differs from the processed one often enough to show the test bites.
    assert sum(int(r[0].argmax()) != w for r, w in zip(rows, want)) >= 16


def test_penalties_apply_in_bf16_batches_and_leave_other_rows_alone():
    logits = torch.tensor([[1.0, 3.0, 2.0], [1.0, 3.0, 2.0]], dtype=torch.bfloat16)
    meta = SamplingMetadata.build([0.0, 0.0], frequency_penalty=[0.0, 2.0], prompt_token_ids=[(), [0]],
                                  output_token_ids=[(), [1]])
    assert Sampler()(logits, meta).token_ids == [1, 2]


def test_penalties_without_token_histories_are_refused():
    with pytest.raises(ValueError, match="penalties need prompt_token_ids and output_token_ids"):
        SamplingMetadata.build([0.0], presence_penalty=[1.0])


def test_a_token_history_grows_by_the_sampled_tokens():
    from tokenweir.model.sampler import TokenHistory

    history = TokenHistory([5, 6, 7], 2, "cpu")
    for step in range(40):  # past several doublings of its buffer
        history.extend([100 + step])
    assert history.prompt.tolist() == [5, 6]
    assert history.output.tolist() == [7] + [100 + s for s in range(40)]

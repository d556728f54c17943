"""Penalties and logit bias, greedy, against transformers on the same weights (fp32): its
`repetition_penalty` and `sequence_bias` are vLLM's repetition penalty and logit bias, and
OpenAI's presence and frequency penalties are written out as a logits processor (the formula
OpenAI documents). Penalised rows share batches, chunked prefills and preemptions with plain
ones, which must still match plain greedy."""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.test_equivalence import SCENARIOS
from tests.hf_reference import hf_greedy
from tokenweir.request import SamplingParams

NUM_NEW = 12


class OpenAIPenalties:
    """transformers logits processor: logit - frequency x count - presence x (count > 0), over
    the tokens generated so far (not the prompt)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores)
        generated = input_ids[:, self.prompt_len:]
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)


def oracle(folder: str, prompt: list[int], params: SamplingParams) -> list[int]:
    from transformers import LogitsProcessorList

    kwargs = {}
    if params.repetition_penalty != 1.0:
        kwargs["repetition_penalty"] = params.repetition_penalty
    if params.logit_bias:
        kwargs["sequence_bias"] = {(t,): b for t, b in params.logit_bias.items()}
    if params.presence_penalty or params.frequency_penalty:
        kwargs["logits_processor"] = LogitsProcessorList(
            [OpenAIPenalties(len(prompt), params.presence_penalty, params.frequency_penalty)])
    return hf_greedy(folder, [prompt], NUM_NEW, pad_token_id=0, **kwargs)[0]


def cases(vocab: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(7)
    greedy = dict(max_tokens=NUM_NEW, min_tokens=NUM_NEW, temperature=0.0)
    settings = [
        {},
        dict(repetition_penalty=1.8),
        dict(repetition_penalty=0.6),
        dict(presence_penalty=1.5),
        dict(frequency_penalty=2.0),
        dict(presence_penalty=-0.5, frequency_penalty=1.0),
        dict(logit_bias={5: 4.0, 17: -100.0, 23: 2.5}),
        dict(repetition_penalty=1.3, frequency_penalty=0.7, logit_bias={9: 3.0}),
        {},
    ]
    out = []
    for i, extra in enumerate(settings):
        # Prompts that repeat tokens, so the repetition penalty has prompt tokens to act on.
        base = [rng.randrange(3, vocab) for _ in range(4 + 3 * i)]
        out.append((base + base[: 2 + i], SamplingParams(**greedy, **extra)))
    return out


@pytest.mark.parametrize("scenario", ["batched", "chunked", "preempted", "swapped"])
def test_penalised_greedy_matches_transformers(make_llm, tiny_model_dir, scenario):
    from tests.model.tiny_models import VOCAB_SIZE

    folder = tiny_model_dir("llama")
    work = cases(VOCAB_SIZE)
    expected = [oracle(folder, prompt, params) for prompt, params in work]
    plain = hf_greedy(folder, [prompt for prompt, _ in work], NUM_NEW, pad_token_id=0)
    # The settings change what the model would say (else this test could not fail).
    assert sum(e != p for e, p in zip(expected, plain)) >= 5
    llm = make_llm(folder, **SCENARIOS[scenario])
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in work], [params for _, params in work], use_tqdm=False)
    for i, (out, e) in enumerate(zip(outs, expected)):
        assert out.outputs[0].token_ids == e, f"case {i} ({work[i][1]}) in scenario {scenario}"
    if scenario in ("preempted", "swapped"):
        assert llm.get_stats().num_preemptions > 0


def test_logit_bias_beyond_the_vocabulary_is_refused_and_others_keep_running(make_llm, tiny_model_dir):
    from tests.model.tiny_models import VOCAB_SIZE

    llm = make_llm(tiny_model_dir("llama"), num_gpu_blocks_override=64)
    with pytest.raises(ValueError, match="logit_bias must name token ids below the vocabulary size"):
        llm.generate({"prompt_token_ids": [4, 5, 6]}, SamplingParams(logit_bias={VOCAB_SIZE: 1.0}), use_tqdm=False)
    out = llm.generate({"prompt_token_ids": [4, 5, 6]}, SamplingParams(max_tokens=3, temperature=0.0,
                                                                      logit_bias={VOCAB_SIZE - 1: 100.0}),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == [VOCAB_SIZE - 1] * 3

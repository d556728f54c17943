"""Resuming a request from outputs another engine produced (the cluster's failover): the engine
continues exactly where the client's stream stopped. Greedy tokens equal transformers' whatever
the resume point; a seeded sampled request, its text (stop strings across the resume point),
logprobs and penalties equal an uninterrupted run's; bad resume states are ValueErrors that
leave nothing behind."""

from __future__ import annotations

import pytest

from tests.engine.helpers import greedy_oracle
from tokenweir import SamplingParams
from tokenweir.engine.core import EngineCore
from tokenweir.engine.output import RequestOutput
from tokenweir.request import ResumeState

NUM_NEW = 20
PROMPTS = {f"r{i}": [3 + (11 * i + j) % 90 for j in range(9 + 5 * i)] for i in range(4)}


@pytest.fixture(scope="module")
def oracle(tiny_model_dir) -> dict[str, list[int]]:
    return greedy_oracle(tiny_model_dir("llama"), PROMPTS, NUM_NEW)


@pytest.fixture
def engine(make_llm, tiny_model_dir) -> EngineCore:
    # Small blocks and budget: a resumed request's recompute is chunked and shares steps.
    return make_llm(tiny_model_dir("llama"), num_gpu_blocks_override=64, block_size=8,
                    max_num_batched_tokens=16, seed=3).engine


def run(engine: EngineCore, requests: dict[str, tuple[list[int], SamplingParams, ResumeState | None]]
        ) -> dict[str, RequestOutput]:
    for rid, (prompt, params, resume) in requests.items():
        engine.add_request(rid, prompt, params, resume=resume)
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for output in engine.step().outputs:
            if output.finished:
                final[output.request_id] = output
    return final


def resume_of(output: RequestOutput, k: int) -> ResumeState:
    completion = output.outputs[0]
    logprobs = None if completion.logprobs is None else tuple(completion.logprobs[:k])
    return ResumeState(tuple(completion.token_ids[:k]), logprobs,
                       sum(next(iter(e.values())) for e in logprobs) if logprobs else 0.0)


@pytest.mark.parametrize("k", [1, 7, NUM_NEW - 1])
def test_greedy_resume_equals_transformers(engine, oracle, k):
    params = SamplingParams(max_tokens=NUM_NEW, min_tokens=NUM_NEW, temperature=0.0)
    resumed = run(engine, {rid: (p, params, ResumeState(tuple(oracle[rid][:k]))) for rid, p in PROMPTS.items()})
    for rid in PROMPTS:
        assert resumed[rid].outputs[0].token_ids == oracle[rid]
        assert resumed[rid].outputs[0].finish_reason == "length"
        assert resumed[rid].prompt_token_ids == PROMPTS[rid]


def test_seeded_sampling_text_logprobs_and_penalties_continue(engine):
    params = SamplingParams(max_tokens=NUM_NEW, min_tokens=NUM_NEW, temperature=0.9, top_k=40, seed=11,
                            logprobs=2, frequency_penalty=0.7, presence_penalty=0.3)
    whole = run(engine, {rid: (p, params, None) for rid, p in PROMPTS.items()})
    for k in (1, 9):
        resumed = run(engine, {f"{rid}-{k}": (p, params, resume_of(whole[rid], k)) for rid, p in PROMPTS.items()})
        for rid in PROMPTS:
            a, b = whole[rid].outputs[0], resumed[f"{rid}-{k}"].outputs[0]
            assert b.token_ids == a.token_ids
            assert b.text == a.text
            # The restored entries are the client's own; later ones are computed in other batch
            # shapes (last-bit differences in the matmuls), the same tokens in the same order.
            assert b.logprobs[:k] == a.logprobs[:k]
            for x, y in zip(b.logprobs[k:], a.logprobs[k:], strict=True):
                assert list(x) == list(y) and list(x.values()) == pytest.approx(list(y.values()), abs=1e-4)
            assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob)


def test_stop_string_across_the_resume_point_ends_the_text_where_it_would(engine):
    plain = SamplingParams(max_tokens=NUM_NEW, min_tokens=NUM_NEW, temperature=0.0)
    whole = run(engine, {"w": (PROMPTS["r2"], plain, None)})["w"].outputs[0]
    words = whole.text.split()
    # Two words starting at the 6th output token: the resume point (7 tokens) falls inside it.
    stop = " ".join(words[5:7])
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0.0, stop=[stop])
    expected = run(engine, {"s": (PROMPTS["r2"], params, None)})["s"].outputs[0]
    assert expected.finish_reason == "stop" and expected.stop_reason == stop
    resumed = run(engine, {"t": (PROMPTS["r2"], params, ResumeState(tuple(whole.token_ids[:6])))})["t"].outputs[0]
    assert (resumed.text, resumed.token_ids, resumed.finish_reason, resumed.stop_reason) == (
        expected.text, expected.token_ids, expected.finish_reason, expected.stop_reason)


@pytest.mark.parametrize("resume, params, message", [
    (ResumeState((5,) * NUM_NEW), SamplingParams(max_tokens=NUM_NEW), "leave no token"),
    (ResumeState((5, 999)), SamplingParams(max_tokens=NUM_NEW), r"restored output token ids must be integers in \[0, 256\)"),
    (ResumeState((5, 6)), SamplingParams(max_tokens=NUM_NEW, logprobs=1), "one logprobs entry per restored token"),
    (ResumeState(()), SamplingParams(max_tokens=NUM_NEW), "restored outputs must be token ids"),
])
def test_bad_resume_states_are_refused_and_leave_nothing(engine, resume, params, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request("bad", PROMPTS["r0"], params, resume=resume)
    assert not engine.has_unfinished_requests() and engine.states == {}
    # The id is free again and the engine serves.
    assert run(engine, {"bad": (PROMPTS["r0"], SamplingParams(max_tokens=2), None)})["bad"].finished

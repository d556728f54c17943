"""The step cost model: compositions read from real scheduler steps, predictions, its JSON form."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.core.helpers import assert_no_leaks, create_scheduler, make_request
from tokenweir.core.cost_model import (DEFAULT_PROFILE, FEATURES, StepComposition, StepCostModel,
                                       chunk_composition, load_cost_model, step_composition)

COEF = {"step": 0.01, "tokens": 0.001, "seqs": 0.0002, "decode_context": 1e-6,
        "prefill_attention": 1e-8, "sampled": 0.0005, "small_step": 0.004, "decode_beyond_knee": 0.0003}


def test_chunk_composition_decode_prefill_and_resumed_prefill() -> None:
    # One decode token after a 10-token prompt and 3 outputs: reads 14 K/V tokens.
    assert chunk_composition(1, 13, 14, 10) == StepComposition(
        num_decode_seqs=1, decode_context_tokens=14, num_sampled=1)
    # A first chunk of 4 of a 10-token prompt: causal pairs 1+2+3+4, nothing sampled.
    assert chunk_composition(4, 0, 10, 10) == StepComposition(
        num_prefill_tokens=4, num_prefill_seqs=1, prefill_attention_pairs=10)
    # The last chunk (6 tokens after 4): 6*4 + 21 pairs, and it samples.
    assert chunk_composition(6, 4, 10, 10) == StepComposition(
        num_prefill_tokens=6, num_prefill_seqs=1, prefill_attention_pairs=45, num_sampled=1)
    # A one-token chunk that ends a prompt is prefill, not decode (it reads no generated token).
    assert chunk_composition(1, 9, 10, 10).num_prefill_tokens == 1


def test_step_composition_of_a_real_scheduler_step() -> None:
    sched = create_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=8)
    sched.add_request(make_request("a", 6, max_tokens=3))
    sched.add_request(make_request("b", 5, max_tokens=3))
    out = sched.schedule(now=0.0)
    comp = step_composition(out, sched.requests, kv_bytes_per_block=100)
    # a: all 6 tokens (samples); b: 2 of 5 under the budget of 8.
    assert comp == StepComposition(num_prefill_tokens=8, num_prefill_seqs=2,
                                   prefill_attention_pairs=21 + 3, num_sampled=1)
    sched.update_from_output(out, {"a": [7]}, now=1.0)
    out = sched.schedule(now=1.0)
    comp = step_composition(out, sched.requests)
    assert comp.num_decode_seqs == 1 and comp.decode_context_tokens == 7
    assert comp.num_prefill_tokens == 3 and comp.num_sampled == 2
    sched.update_from_output(out, {"a": [7], "b": [7]}, now=2.0)
    sched.abort_requests(["a", "b"])
    assert_no_leaks(sched)


def test_predict_is_the_linear_form_and_an_empty_step_is_free() -> None:
    model = StepCostModel(COEF, swap_bytes_per_second=1e9, small_step_max_tokens=4)
    comp = StepComposition(num_prefill_tokens=100, num_prefill_seqs=1, prefill_attention_pairs=5050,
                           num_decode_seqs=3, decode_context_tokens=300, num_sampled=4, swap_bytes=2_000_000)
    expected = 0.01 + 103 * 0.001 + 4 * 0.0002 + 300e-6 + 5050e-8 + 4 * 0.0005 + 2e6 / 1e9
    assert model.predict(comp) == pytest.approx(expected)
    small = StepComposition(num_decode_seqs=2, decode_context_tokens=10, num_sampled=2)
    assert model.predict(small) == pytest.approx(0.01 + 0.002 + 0.0004 + 10e-6 + 0.001 + 0.004)
    assert model.predict(StepComposition()) == 0.0


def test_decode_rows_beyond_the_knee_pay_the_extra() -> None:
    model = StepCostModel(COEF, swap_bytes_per_second=1e9, decode_knee=2)
    def decode(n: int) -> StepComposition:
        return StepComposition(num_decode_seqs=n, decode_context_tokens=10 * n, num_sampled=n)
    per_row = 0.001 + 0.0002 + 10e-6 + 0.0005
    assert model.predict(decode(2)) == pytest.approx(0.01 + 2 * per_row)
    assert model.predict(decode(5)) == pytest.approx(0.01 + 5 * per_row + 3 * 0.0003)
    # Prefill tokens are not decode rows: a recompute's marginal cost has no knee term.
    assert model.prefill_seconds(3, 10) == StepCostModel(COEF, 1e9).prefill_seconds(3, 10)


def test_prefill_seconds_is_the_marginal_cost_without_the_step_term() -> None:
    model = StepCostModel(COEF, swap_bytes_per_second=1e9, small_step_max_tokens=4)
    # 3 tokens after 10 cached: 3 tokens, 1 row, 3*10+6 pairs, one sampled row; no small-step extra.
    assert model.prefill_seconds(3, 10) == pytest.approx(0.003 + 0.0002 + 36e-8 + 0.0005)
    assert model.prefill_seconds(0, 10) == 0.0
    assert model.swap_seconds(4e9) == pytest.approx(4.0)


def test_json_round_trip_and_bad_profiles(tmp_path) -> None:
    model = StepCostModel(COEF, 2e9, {"model": "m"}, small_step_max_tokens=4, decode_knee=8)
    assert StepCostModel.from_dict(json.loads(json.dumps(model.to_dict()))) == model
    path = tmp_path / "p.json"
    path.write_text(json.dumps(model.to_dict()))
    assert load_cost_model(path) == model

    with pytest.raises(ValueError, match="does not exist"):
        load_cost_model(tmp_path / "missing.json")
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not readable JSON"):
        load_cost_model(path)
    path.write_text(json.dumps({"coefficients": COEF}))
    with pytest.raises(ValueError, match="not a step cost profile"):
        load_cost_model(path)
    bad = model.to_dict()
    del bad["coefficients"]["tokens"]
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"missing \['tokens'\]"):
        load_cost_model(path)
    for field, value, match in (("tokens", -1.0, "finite number >= 0"), ("tokens", "x", "finite number"),
                                ("tokens", float("nan"), "finite"), ("tokens", True, "finite number")):
        bad = model.to_dict()
        bad["coefficients"][field] = value
        with pytest.raises(ValueError, match=match):
            StepCostModel.from_dict(bad)
    bad = model.to_dict()
    bad["swap_bytes_per_second"] = 0
    with pytest.raises(ValueError, match="swap_bytes_per_second"):
        StepCostModel.from_dict(bad)
    for value in (-1, 2.5, True, "8"):
        bad = model.to_dict()
        bad["decode_knee"] = value
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=r"^cost profile .*: cost model decode_knee must be an integer >= 0, got"):
            load_cost_model(path)
    # What a hand edit could get wrong and nothing else would notice.
    for edit, match in ((lambda d: d.update(decode_kne=8), r"unknown keys \['decode_kne'\]"),
                        (lambda d: d.pop("decode_knee"), "'decode_beyond_knee' is 0.0003 but decode_knee is 0"),
                        (lambda d: d.update(small_step_max_tokens=0), "'small_step' is 0.004 but small_step_max_tokens"),
                        (lambda d: d.update(swap_bytes_per_second=True), "swap_bytes_per_second must be a finite"),
                        (lambda d: d["coefficients"].update(step=0.0, tokens=0.0), "a step would take no time")):
        bad = model.to_dict()
        edit(bad)
        with pytest.raises(ValueError, match=match):
            StepCostModel.from_dict(bad)
    # A profile written before the knee existed (no knee, no coefficient for it) has none.
    old = model.to_dict()
    del old["decode_knee"], old["coefficients"]["decode_beyond_knee"]
    assert StepCostModel.from_dict(old).decode_knee == 0
    assert StepCostModel.from_dict(old).coefficients["decode_beyond_knee"] == 0.0


def test_the_shipped_profile_loads_and_describes_the_default_model() -> None:
    model = load_cost_model(None)
    assert DEFAULT_PROFILE.exists()
    assert set(model.coefficients) == set(FEATURES)
    assert model.metadata["model"] == "SmolLM2-135M-Instruct" and model.metadata["device"] == "cpu"
    # A decode step of the default model on CPU takes milliseconds, a 512-token prefill longer.
    decode = model.predict(StepComposition(num_decode_seqs=8, decode_context_tokens=8 * 300, num_sampled=8))
    prefill = model.predict(chunk_composition(512, 0, 512, 512))
    assert 0.001 < decode < prefill


def test_adding_compositions_adds_every_field():
    fields = [f.name for f in dataclasses.fields(StepComposition)]
    a = StepComposition(*range(1, len(fields) + 1))
    b = StepComposition(*(10 ** i for i in range(len(fields))))
    assert [getattr(a + b, f) for f in fields] == [getattr(a, f) + getattr(b, f) for f in fields]

"""`tokenweir profile` end to end on a tiny model: the engine grid, the serving step trace, and a
profile that `tokenweir simulate` then runs on."""

from __future__ import annotations

import json

import pytest

from tokenweir.cli import main
from tokenweir.core.cost_model import StepComposition, load_cost_model
from tokenweir.engine.step_trace import StepTrace, read_step_trace

TINY = ["--dtype", "float32", "--num-gpu-blocks-override", "256", "--block-size", "16"]


def check_profile(path, source: str) -> dict:
    data = json.loads(path.read_text())
    model = load_cost_model(path)
    meta = model.metadata
    assert source in meta["source"]
    assert meta["kv_cache_bytes"] == 256 * meta["kv_bytes_per_block"] and meta["block_size"] == 16
    assert meta["fit_error"]["all"]["samples"] == len(data["samples"]) > 10
    # The fit is what the samples say: its own error table is recomputable from them.
    errors = [abs(model.predict(StepComposition(**{k: v for k, v in s.items() if k not in ("seconds", "region")}))
                  - s["seconds"]) / s["seconds"] for s in data["samples"]]
    assert meta["fit_error"]["all"]["mape"] == pytest.approx(sum(errors) / len(errors), abs=1e-4)
    return data


def test_profile_grid_then_simulate_with_it(tiny_model_dir, tmp_path, capsys) -> None:
    out = tmp_path / "p.json"
    main(["profile", "--model", tiny_model_dir("llama"), *TINY, "--grid", "quick", "--output", str(out)])
    printed = capsys.readouterr().out
    assert "MAPE" in printed and "decode" in printed and "prefill" in printed
    data = check_profile(out, "engine step grid")
    assert {s["region"] for s in data["samples"]} == {"decode", "prefill", "mixed"}
    main(["simulate", "--profile", str(out), "--disable-tqdm", "--dataset-name", "random", "--num-prompts", "10",
          "--random-input-len", "20", "--random-output-len", "5", "--result-dir", str(tmp_path),
          "--result-filename", "s.json"])
    assert json.loads((tmp_path / "s.json").read_text())["completed"] == 10


def test_profile_serving_fits_the_servers_own_step_trace(tiny_model_dir, tmp_path, capsys) -> None:
    out = tmp_path / "serving.json"
    main(["profile", "--serving", "--model", tiny_model_dir("llama"), *TINY, "--grid", "quick",
          "--output", str(out)])
    data = check_profile(out, "step trace")
    assert "decode" in {s["region"] for s in data["samples"]}
    # `serve`'s engine process runs every step on all of torch's threads: no small-step term.
    assert data["small_step_max_tokens"] == 0 and data["coefficients"]["small_step"] == 0.0


def test_step_trace_records_loop_periods_and_skips_idle_gaps(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    trace = StepTrace(path)
    trace.write_header({"model": "m", "kv_bytes_per_block": 64})
    a = StepComposition(num_decode_seqs=2, decode_context_tokens=10, num_sampled=2)
    b = StepComposition(num_prefill_tokens=5, num_prefill_seqs=1, prefill_attention_pairs=15)
    trace.step_started(a)
    trace.step_started(b)  # closes a
    trace.went_idle()  # b's period would include the wait: dropped
    trace.step_started(a)
    trace.step_started(StepComposition())  # closes a; an empty step is not kept
    trace.step_started(b)
    trace.close()
    engine, samples = read_step_trace(path)
    assert engine == {"model": "m", "kv_bytes_per_block": 64}
    assert [c for c, _ in samples] == [a, a] and all(s > 0 for _, s in samples)
    path.write_text('{"num_prefill_tokens": 1}\n')
    with pytest.raises(ValueError, match="line 1: not the engine header"):
        read_step_trace(path)
    path.write_text('{"engine": {}}\n{"num_prefill_tokens": 1}\n')
    with pytest.raises(ValueError, match="line 2: not a step record"):
        read_step_trace(path)
    path.write_text("")
    with pytest.raises(ValueError, match="is empty"):
        read_step_trace(path)

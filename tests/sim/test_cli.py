"""`tokenweir simulate` and `tokenweir simulate search` end to end, through the CLI entry point."""

from __future__ import annotations

import json
import math

import pytest

from tests.sim.helpers import cost_model, write_profile
from tokenweir.cli import main
from tokenweir.sim.search import find_capacity

WORKLOAD = ["--dataset-name", "random", "--num-prompts", "40", "--random-input-len", "64",
            "--random-output-len", "16", "--random-range-ratio", "0.5", "--request-rate", "20"]


@pytest.fixture
def profile(tmp_path):
    return write_profile(tmp_path / "profile.json", cost_model(step=0.01, tokens=0.0005, decode_context=1e-6))


def simulate(tmp_path, profile, *extra: str, name: str = "r.json") -> dict:
    main(["simulate", "--profile", str(profile), "--disable-tqdm", "--result-dir", str(tmp_path),
          "--result-filename", name, *WORKLOAD, *extra])
    return json.loads((tmp_path / name).read_text())


def test_simulate_writes_bench_serve_keys_and_simulation_fields(tmp_path, profile, capsys) -> None:
    data = simulate(tmp_path, profile, "--goodput", "ttft:200", "tpot:50", "--plot-dir", str(tmp_path / "plots"))
    out = capsys.readouterr().out
    assert out.startswith("SIMULATED with profile") and "Serving Benchmark Result" in out
    for key in ("median_ttft_ms", "p99_tpot_ms", "p99_itl_ms", "mean_e2el_ms", "request_throughput",
                "output_throughput", "request_goodput", "simulated_seconds", "wall_seconds",
                "num_steps", "num_preemptions", "timeseries"):
        assert key in data, key
    assert data["simulated"] is True and data["profile"]["model"] == "synthetic"
    assert data["completed"] == 40 and data["failed"] == 0
    assert data["total_output_tokens"] == sum(data["output_lens"])
    assert set(data["timeseries"]) >= {"time_s", "num_waiting", "num_running", "kv_cache_usage",
                                       "num_preemptions", "tokens_per_step"}
    for png in ("latency_cdf.png", "timeseries.png"):
        assert (tmp_path / "plots" / png).read_bytes()[:4] == b"\x89PNG"


def test_same_flags_give_byte_identical_results(tmp_path, profile) -> None:
    simulate(tmp_path, profile, "--no-wall-time", name="a.json")
    simulate(tmp_path, profile, "--no-wall-time", name="b.json")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert "wall_seconds" not in json.loads((tmp_path / "a.json").read_text())
    simulate(tmp_path, profile, "--no-wall-time", "--seed", "1", name="c.json")
    assert (tmp_path / "a.json").read_bytes() != (tmp_path / "c.json").read_bytes()


def test_engine_flags_change_the_simulated_engine(tmp_path, profile) -> None:
    small = simulate(tmp_path, profile, "--num-gpu-blocks-override", "12", "--max-num-seqs", "8", name="s.json")
    large = simulate(tmp_path, profile, "--num-gpu-blocks-override", "1000", name="l.json")
    assert small["num_preemptions"] > 0 and large["num_preemptions"] == 0
    assert small["engine_args"]["max_num_seqs"] == 8
    assert small["median_e2el_ms"] > large["median_e2el_ms"]


def test_the_shipped_profile_is_the_default(tmp_path) -> None:
    main(["simulate", "--disable-tqdm", "--result-dir", str(tmp_path), "--result-filename", "d.json", *WORKLOAD])
    data = json.loads((tmp_path / "d.json").read_text())
    assert data["profile"]["path"].startswith("(shipped)") and data["profile"]["model"] == "SmolLM2-135M-Instruct"
    assert data["completed"] == 40


def test_bad_profile_and_bad_flags_are_one_line_errors(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["simulate", "--profile", str(tmp_path / "missing.json"), *WORKLOAD])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.count("\n") == 0 and "does not exist" in err
    (tmp_path / "bad.json").write_text('{"format": "tokenweir-step-cost/1"}')
    with pytest.raises(SystemExit):
        main(["simulate", "--profile", str(tmp_path / "bad.json"), *WORKLOAD])
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "missing or has a malformed field" in err
    for argv, match in ((["simulate", "--max-num-seqs", "many"], "invalid int value"),
                        (["simulate", "search", "--max-num-seqs", "1,x"], "comma-separated int"),
                        (["simulate", "--num-prompts", "0"], "--num-prompts must be >= 1"),
                        (["simulate", "search", "--request-rate", "1"], "needs SLOs"),
                        (["simulate", "--num-prompts", "5", "search", "--goodput", "ttft:100"],
                         "give `search` right after `simulate`"),
                        (["simulate", "search", "--plot-dir", "x", "--goodput", "ttft:100"],
                         "unrecognized arguments: --plot-dir"),
                        (["simulate", "--model", "x"], "are the cost profile's"),
                        (["simulate", "--scheduling-policy", "sla", "--sla-kv-load-weight", "2"],
                         "sla kv_load_weight must be in [0, 1]"),
                        (["simulate", "search", "--dtype", "fp32"], "are the cost profile's"),
                        (["profile", "--serving", "--serving-threads", "--output", "x.json"],
                         "--serving-threads applies to the engine grid only")):
        with pytest.raises(SystemExit):
            main(argv)
        assert match in capsys.readouterr().err


def test_find_capacity_brackets_a_known_threshold() -> None:
    calls = []

    def passes(rate: float) -> tuple[bool, float]:
        calls.append(rate)
        return rate <= 7.3, rate

    rate, score, runs = find_capacity(passes, start=1.0, iterations=12)
    assert 7.3 - 8 / 2**12 <= rate <= 7.3 and score == rate and runs == len(calls)
    # A start above capacity halves first.
    rate, _, _ = find_capacity(passes, start=100.0, iterations=12)
    assert 7.3 - 100 / 2**12 <= rate <= 7.3
    assert find_capacity(lambda r: (False, 0.0), start=1.0, iterations=3)[0] == 0.0


def test_search_finds_the_capacity_of_a_queue_it_can_be_computed_for(tmp_path, capsys) -> None:
    # Each request is one step of 0.1 s (1-token prompt, 1 output token, one sequence at a time)
    # and requests arrive at fixed gaps 1/rate: a D/D/1 queue. Above 10 req/s the k-th request
    # waits k*(0.1 - 1/rate) more than the 0.1 s of its step, so "TTFT <= 250 ms for 90 of 100"
    # holds up to rate = 1 / (0.1 - 0.15/89). Two sequences per step double the service rate
    # (a request then waits at most one step for the one in flight, 0.2 s in all).
    profile = write_profile(tmp_path / "p.json", cost_model(step=0.1))
    main(["simulate", "search", "--profile", str(profile), "--dataset-name", "random",
          "--num-prompts", "100", "--random-input-len", "1", "--random-output-len", "1",
          "--burstiness", "inf", "--max-num-batched-tokens", "2", "--max-num-seqs", "1,2",
          "--goodput", "ttft:250", "--search-iterations", "10", "--result-dir", str(tmp_path),
          "--result-filename", "s.json"])
    data = json.loads((tmp_path / "s.json").read_text())
    first, second = data["capacities"]
    assert first["engine_args"] == {"max_num_seqs": 2} and second["engine_args"] == {"max_num_seqs": 1}
    expected = 1 / (0.1 - 0.15 / 89)
    assert expected - 0.01 <= second["request_rate"] <= expected
    assert first["request_rate"] > 1.8 * second["request_rate"]
    assert not math.isinf(first["request_rate"])
    assert "SIMULATED capacity" in capsys.readouterr().out


def test_search_refuses_a_rate_step_and_simulate_replays_one(tmp_path, capsys) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n" + "".join(
        f"{i}.0,8,2\n" for i in range(6)))
    profile = write_profile(tmp_path / "p.json", cost_model(step=0.01))
    stepped = ["--dataset-name", "trace", "--trace-path", str(trace), "--num-prompts", "6", "--rate-step", "3:2"]
    with pytest.raises(SystemExit):
        main(["simulate", "search", "--profile", str(profile), *stepped, "--goodput", "ttft:250"])
    assert "takes no --rate-step" in capsys.readouterr().err
    main(["simulate", "--profile", str(profile), "--disable-tqdm", "--result-dir", str(tmp_path),
          "--result-filename", "s.json", *stepped])
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["rate_step"] == "3:2" and data["completed"] == 6



def test_search_sweeps_values_that_contain_commas_separated_by_semicolons(tmp_path) -> None:
    # A combination order and tenant weights have commas of their own: ';' separates the values.
    profile = write_profile(tmp_path / "p.json", cost_model(step=0.01))
    main(["simulate", "search", "--profile", str(profile), *WORKLOAD, "--goodput", "ttft:1000",
          "--search-iterations", "2", "--enable-prefix-caching",
          "--admission-order", "policy;cache-aware,sampling-grouped", "--max-num-seqs", "4,8",
          "--result-dir", str(tmp_path), "--result-filename", "s.json"])
    swept = {(c["engine_args"]["admission_order"], c["engine_args"]["max_num_seqs"])
             for c in json.loads((tmp_path / "s.json").read_text())["capacities"]}
    assert swept == {(o, n) for o in ("policy", "cache-aware,sampling-grouped") for n in (4, 8)}
    main(["simulate", "search", "--profile", str(profile), *WORKLOAD, "--goodput", "ttft:1000",
          "--search-iterations", "2", "--scheduling-policy", "vtc",
          "--vtc-tenant-weights", "a=1,b=1; a=2,b=1", "--result-dir", str(tmp_path), "--result-filename", "v.json"])
    weights = [c["engine_args"]["vtc_tenant_weights"] for c in json.loads((tmp_path / "v.json").read_text())["capacities"]]
    assert sorted(weights) == ["a=1,b=1", "a=2,b=1"]


def test_search_gives_the_profile_to_the_sla_policy_as_simulate_does(tmp_path, monkeypatch) -> None:
    # The simulated machine is the profile's: under sla its SLO guard and deadline checks must
    # predict by that profile in every run search makes, as in simulate's one run. The runs are
    # real; the wrapper only records the engine args each was given.
    import tokenweir.sim.search as search_module

    given = []
    real = search_module.simulate

    def recording(args, ns, cost_model, **kw):
        given.append(args.sla_cost_profile)
        return real(args, ns, cost_model, **kw)

    monkeypatch.setattr(search_module, "simulate", recording)
    profile = write_profile(tmp_path / "p.json", cost_model(step=0.01))
    main(["simulate", "search", "--profile", str(profile), *WORKLOAD, "--scheduling-policy", "sla",
          "--sla-drop-unmeetable", "--goodput", "ttft:1000", "--search-iterations", "1",
          "--result-dir", str(tmp_path), "--result-filename", "s.json"])
    assert given and set(given) == {str(profile)}


def test_simulate_a_cluster_of_replicas(tmp_path, profile, capsys) -> None:
    one = simulate(tmp_path, profile, "--max-num-seqs", "4", "--no-wall-time", name="one.json")
    two = simulate(tmp_path, profile, "--max-num-seqs", "4", "--no-wall-time", "--data-parallel-size", "2",
                   "--routing-policy", "least_loaded", name="two.json")
    assert two["data_parallel_size"] == 2 and two["routing_policy"] == "least_loaded"
    assert two["dispatch_queue_depth"] == 2 and "data_parallel_size" not in one
    assert two["completed"] == one["completed"] == 40
    assert two["output_lens"] == one["output_lens"]
    assert two["median_ttft_ms"] < one["median_ttft_ms"]  # two engines' worth of sequence slots
    capsys.readouterr()
    with pytest.raises(SystemExit):  # Ray's flags are the server's
        simulate(tmp_path, profile, "--data-parallel-size", "2", "--ray-address=auto")
    assert "unrecognized arguments: --ray-address" in capsys.readouterr().err


def test_search_a_cluster_records_it_and_two_replicas_double_the_queues_capacity(tmp_path) -> None:
    # The D/D/1 queue above, served by two replicas of one sequence each.
    profile = write_profile(tmp_path / "p.json", cost_model(step=0.1))
    main(["simulate", "search", "--profile", str(profile), "--dataset-name", "random",
          "--num-prompts", "100", "--random-input-len", "1", "--random-output-len", "1",
          "--burstiness", "inf", "--max-num-batched-tokens", "2", "--max-num-seqs", "1",
          "--goodput", "ttft:250", "--search-iterations", "10", "--result-dir", str(tmp_path),
          "--result-filename", "s.json", "--data-parallel-size", "2", "--routing-policy", "least_loaded"])
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["data_parallel_size"] == 2 and data["routing_policy"] == "least_loaded"
    assert data["capacities"][0]["request_rate"] > 1.8 / (0.1 - 0.15 / 89)

import argparse
import math
from pathlib import Path

import numpy as np
import pytest

from tokenweir.bench.datasets import (PromptBuilder, make_prefix_requests, make_random_requests,
                                      make_trace_requests, rate_step_arrivals, read_trace,
                                      sample_lengths)
from tokenweir.bench.serve import add_cli_args, build_workload, check_counts, default_trace_path


class CharTokenizer:
    """One token per character: every word is several tokens, which exercises truncation."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(i) for i in token_ids)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_lengths_stay_within_range_ratio_and_reach_both_ends():
    lens = sample_lengths(100, 0.25, 5000, rng())
    assert lens.min() == 75 and lens.max() == 125


def test_range_ratio_bounds_round_outwards():
    lens = sample_lengths(5, 0.5, 5000, rng())
    assert lens.min() == 2 and lens.max() == 8  # floor(2.5), ceil(7.5)


def test_zero_range_ratio_is_fixed_and_invalid_ratio_rejected():
    assert set(sample_lengths(64, 0.0, 100, rng()).tolist()) == {64}
    with pytest.raises(ValueError):
        sample_lengths(64, 1.0, 10, rng())


def test_random_requests_without_tokenizer_use_one_word_per_token():
    reqs = make_random_requests(50, 40, 10, 0.5, PromptBuilder(rng()), rng(1))
    for r in reqs:
        assert 20 <= r.prompt_len <= 60 and 5 <= r.output_len <= 15
        assert len(r.prompt.split()) == r.prompt_len
    # Random words per prompt: no two prompts share even their first words by design.
    assert len({tuple(r.prompt.split()[:4]) for r in reqs}) == len(reqs)


def test_random_requests_with_tokenizer_have_exact_lengths():
    reqs = make_random_requests(20, 33, 4, 0.3, PromptBuilder(rng(), CharTokenizer()), rng())
    for r in reqs:
        assert len(r.prompt) == r.prompt_len
        assert math.floor(33 * 0.7) <= r.prompt_len <= math.ceil(33 * 1.3)


def test_random_requests_are_seed_reproducible():
    def make(seed):
        return make_random_requests(5, 16, 4, 0.5, PromptBuilder(rng(seed)), rng(seed))
    assert make(3) == make(3)
    assert make(3) != make(4)


@pytest.mark.parametrize("tokenizer", [None, CharTokenizer()])
def test_prefix_requests_share_the_exact_prefix(tokenizer):
    reqs = make_prefix_requests(10, 30, 12, 8, 0.0, PromptBuilder(rng(), tokenizer), rng())
    if tokenizer is None:
        prefix = " ".join(reqs[0].prompt.split()[:30])
        assert all(r.prompt_len == 42 for r in reqs)
    else:
        prefix = reqs[0].prompt[:30]
        assert all(r.prompt_len == len(r.prompt) for r in reqs)
    assert all(r.prompt.startswith(prefix + " ") for r in reqs)
    suffixes = {r.prompt[len(prefix):] for r in reqs}
    assert len(suffixes) == len(reqs)
    assert all(r.output_len == 8 for r in reqs)


def test_prefix_requests_draw_one_of_several_prefixes():
    reqs = make_prefix_requests(40, 30, 12, 8, 0.0, PromptBuilder(rng()), rng(), num_prefixes=3)
    prefixes = [tuple(r.prompt_token_ids[:30]) for r in reqs]
    assert len(set(prefixes)) == 3
    assert len({tuple(r.prompt_token_ids[30:]) for r in reqs}) == len(reqs)


def write_trace(path: Path) -> Path:
    path.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n"
                    "10.0,100,7\n11.0,3000,50\n14.0,20,900\n15.0,5,5\n")
    return path


def test_trace_replays_first_rows_with_rate_scale_and_caps(tmp_path):
    rows = read_trace(write_trace(tmp_path / "t.csv"), 3, rate_scale=2.0,
                      max_input_len=1000, max_output_len=100)
    assert [r.arrival_s for r in rows] == [0.0, 0.5, 2.0]
    assert [r.prompt_len for r in rows] == [100, 1000, 20]
    assert [r.output_len for r in rows] == [7, 50, 100]
    reqs = make_trace_requests(rows, PromptBuilder(rng()))
    assert [len(r.prompt.split()) for r in reqs] == [100, 1000, 20]


def test_trace_too_short_or_bad_scale(tmp_path):
    path = write_trace(tmp_path / "t.csv")
    with pytest.raises(ValueError):
        read_trace(path, 5)
    with pytest.raises(ValueError):
        read_trace(path, 2, rate_scale=0.0)
    with pytest.raises(ValueError, match=r"^max input length must be >= 1 \(a cap on a trace's lengths\), got 0$"):
        read_trace(path, 2, max_input_len=0)
    with pytest.raises(ValueError, match=r"^max output length must be >= 1"):
        read_trace(path, 2, max_output_len=-3)


@pytest.mark.parametrize("second_row, message", [
    ("0.5,10,5", r"line 3: arrived_at 0.5 is before the row above it \(1.0\): a trace must be in arrival order"),
    ("nan,10,5", r"line 3: arrived_at must be finite, got 'nan'"),
    ("2.0,0,5", r"line 3: num_prefill_tokens must be a whole number >= 1, got 0"),
    ("2.0,10,-3", r"line 3: num_decode_tokens must be a whole number >= 1, got -3"),
    ("2.0,10.5,3", r"line 3: num_prefill_tokens must be a whole number >= 1, got 10.5"),
    ("2.0,ten,3", r"line 3: num_prefill_tokens must be a number, got 'ten'"),
    ("2.0,10", r"line 3: num_decode_tokens must be a number, got None"),
])
def test_a_trace_row_that_is_not_a_request_is_named(tmp_path, second_row, message):
    path = tmp_path / "t.csv"
    path.write_text(f"arrived_at,num_prefill_tokens,num_decode_tokens\n1.0,10,5\n{second_row}\n3.0,10,5\n")
    with pytest.raises(ValueError, match=message):
        read_trace(path, 3)
    assert len(read_trace(path, 1)) == 1  # rows past those asked for are not read


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return parser.parse_args(argv)


def test_trace_workload_takes_arrivals_from_the_trace(tmp_path):
    path = write_trace(tmp_path / "t.csv")
    w = build_workload(parse(["--dataset-name", "trace", "--trace-path", str(path),
                              "--num-prompts", "4", "--rate-scale", "0.5"]), None)
    assert w.arrivals.tolist() == [0.0, 2.0, 8.0, 10.0]
    with pytest.raises(ValueError, match="rate-scale"):
        build_workload(parse(["--dataset-name", "trace", "--trace-path", str(path),
                              "--request-rate", "3"]), None)


def test_gaps_before_the_step_are_scaled_by_one_rate_and_after_by_the_other():
    times = rate_step_arrivals([10.0, 12.0, 16.0, 20.0, 21.0], 2, 0.5, 4.0)
    # Gaps 2, 4, 4, 1: the first (before request 2) slowed 2x, those from request 2 on 4x faster.
    assert times == pytest.approx([0.0, 4.0, 5.0, 6.0, 6.25])


def test_a_bad_rate_step_is_refused():
    with pytest.raises(ValueError, match=r"rate step needs scales > 0 and an index in \[0, 2\]"):
        rate_step_arrivals([0.0, 1.0], 3, 1.0, 2.0)
    with pytest.raises(ValueError, match="rate step needs scales > 0"):
        rate_step_arrivals([0.0, 1.0], 1, 0.0, 2.0)


def test_trace_workload_steps_its_rate_from_the_row_given(tmp_path):
    path = write_trace(tmp_path / "t.csv")
    w = build_workload(parse(["--dataset-name", "trace", "--trace-path", str(path), "--num-prompts", "4",
                              "--rate-scale", "0.5", "--rate-step", "2:4"]), None)
    # Trace gaps 1, 3, 1: the one before row 1 at half the rate, those into rows 2 and 3 4x faster.
    assert w.arrivals.tolist() == pytest.approx([0.0, 2.0, 2.75, 3.0])
    with pytest.raises(ValueError, match="bad --rate-step '2'"):
        build_workload(parse(["--dataset-name", "trace", "--trace-path", str(path), "--num-prompts", "4",
                              "--rate-step", "2"]), None)
    with pytest.raises(ValueError, match="needs --dataset-name trace"):
        build_workload(parse(["--num-prompts", "4", "--request-rate", "3", "--rate-step", "2:4"]), None)


def test_random_workload_arrivals_end_at_n_over_rate():
    w = build_workload(parse(["--num-prompts", "12", "--request-rate", "3",
                              "--random-input-len", "8", "--random-output-len", "2"]), None)
    assert len(w.requests) == 12 and w.arrivals[-1] == 4.0


@pytest.mark.skipif(default_trace_path() is None, reason="shared Azure trace not present")
def test_shared_azure_trace_reads():
    rows = read_trace(default_trace_path(), 200, rate_scale=1.0, max_input_len=2048)
    assert rows[0].arrival_s == 0.0 and len(rows) == 200
    assert all(1 <= r.prompt_len <= 2048 for r in rows)
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(rows, rows[1:]))


@pytest.mark.parametrize("flags, message", [
    (["--random-output-len", "0"], r"^--random-output-len must be >= 1, got 0$"),
    (["--random-input-len", "-5"], r"^--random-input-len must be >= 1, got -5$"),
    (["--dataset-name", "prefix", "--prefix-len=-1"], r"^--prefix-len must be >= 1, got -1$"),
    (["--rate-scale", "2"], r"^--rate-scale applies to --dataset-name trace only, not random$"),
    (["--max-output-len", "8"], r"^--max-output-len applies to --dataset-name trace only, not random$"),
])
def test_workload_flags_that_would_do_nothing_or_make_no_request_are_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        check_counts(parse(["--num-prompts", "2", *flags]))

import pytest

from tokenweir.bench.client import StreamTimer, build_payload, choice_text
from tokenweir.bench.datasets import BenchRequest
from tokenweir.bench.serve import parse_goodput, parse_percentiles, parse_selected_metrics

REQUEST = BenchRequest("hello world", 2, 7)


def test_completions_payload():
    p = build_payload("/v1/completions", "m", REQUEST, ignore_eos=True)
    assert p["prompt"] == "hello world" and p["max_tokens"] == 7
    assert p["stream"] is True and p["stream_options"] == {"include_usage": True}
    assert p["temperature"] == 0.0 and p["ignore_eos"] is True
    assert "messages" not in p


def test_chat_payload_without_ignore_eos():
    p = build_payload("/v1/chat/completions", "m", REQUEST, ignore_eos=False)
    assert p["messages"] == [{"role": "user", "content": "hello world"}]
    assert p["max_tokens"] == p["max_completion_tokens"] == 7
    assert "ignore_eos" not in p and "prompt" not in p


@pytest.mark.parametrize("choice, text", [
    ({"index": 0, "text": " a"}, " a"),
    ({"index": 0, "text": None, "finish_reason": "stop"}, ""),
    ({"index": 0, "delta": {"role": "assistant", "content": ""}}, ""),
    ({"index": 0, "delta": {"content": "b"}}, "b"),
    ({"index": 0, "delta": {"reasoning_content": "hm"}}, "hm"),
    ({"index": 0, "delta": {}, "finish_reason": "length"}, ""),
])
def test_choice_text(choice, text):
    assert choice_text(choice) == text


def timed(events: list[tuple[float, dict]], start: float = 8.0):
    """Feed (arrival time, SSE data) pairs to a timer; times are binary fractions, so the
    expected gaps below are exact."""
    timer = StreamTimer(REQUEST, start)
    for now, data in events:
        timer.on_event(data, now)
    return timer.finish()


def delta(**fields):
    return {"choices": [{"index": 0, "delta": fields}], "usage": None}


def test_every_chunk_with_choices_is_timed_even_without_text():
    record = timed([
        (8.25, delta(role="assistant", content="")),    # TTFT, though it has no text
        (8.5, delta(content="Hel")),                     # gap 0.25
        (9.0, delta(content="lo")),                      # gap 0.5
        (9.5, {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}),  # gap 0.5
        # The usage summary has no choices: not timed, and the latency ends at 9.5.
        (9.75, {"choices": [], "usage": {"prompt_tokens": 99, "completion_tokens": 4}}),
    ])
    assert record.success and record.error == ""
    assert record.ttft == 0.25
    assert record.itl == [0.25, 0.5, 0.5]
    assert record.latency == 1.5
    assert record.generated_text == "Hello"
    assert record.output_tokens == 4  # from usage, not from the 4 chunks or 2 text chunks
    assert record.prompt_len == 2     # the dataset's length, not usage.prompt_tokens (99)
    assert record.tpot == (1.5 - 0.25) / 3


def test_completion_stream_without_usage_counts_text_chunks():
    def text(t):
        return {"choices": [{"index": 0, "text": t, "finish_reason": None}]}

    record = timed([(8.5, text(" a")), (8.75, text("")), (9.0, text(" b")), (10.0, text(""))])
    assert (record.ttft, record.itl, record.latency) == (0.5, [0.25, 0.25, 1.0], 2.0)
    assert record.generated_text == " a b"
    assert record.output_tokens == 2


def test_stream_without_choices_fails():
    record = timed([(9.0, {"choices": [], "usage": {"completion_tokens": 0}})])
    assert not record.success and "no chunk with choices" in record.error
    assert record.ttft == 0.0 and record.itl == []


def test_cli_value_parsers():
    assert parse_goodput(["ttft:500", "e2el:2000.5"]) == {"ttft": 500.0, "e2el": 2000.5}
    assert parse_goodput(None) == {}
    for bad in (["itl:5"], ["ttft"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    with pytest.raises(ValueError, match=r"^--goodput ttft must be a number of ms, got 'fast'$"):
        parse_goodput(["ttft:fast"])
    with pytest.raises(ValueError, match=r"^--goodput ttft must be a finite number of ms >= 0, got 'nan'$"):
        parse_goodput(["ttft:nan"])
    assert parse_selected_metrics("ttft, e2el") == ["ttft", "e2el"]
    with pytest.raises(ValueError):
        parse_selected_metrics("ttft,foo")
    assert parse_percentiles("50,99.9") == [50.0, 99.9]
    with pytest.raises(ValueError):
        parse_percentiles("0,50")

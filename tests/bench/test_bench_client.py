import pytest

from tokenweir.bench.client import build_payload, parse_chunk
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


@pytest.mark.parametrize("data, expected", [
    ({"choices": [{"index": 0, "text": " a"}]}, (" a", None)),
    ({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}, ("", None)),
    ({"choices": [{"index": 0, "delta": {"content": "b"}}]}, ("b", None)),
    ({"choices": [{"index": 0, "delta": {"reasoning_content": "hm"}}]}, ("hm", None)),
    ({"choices": [], "usage": {"completion_tokens": 3}}, ("", {"completion_tokens": 3})),
])
def test_parse_chunk(data, expected):
    assert parse_chunk(data) == expected


def test_cli_value_parsers():
    assert parse_goodput(["ttft:500", "e2el:2000.5"]) == {"ttft": 500.0, "e2el": 2000.5}
    assert parse_goodput(None) == {}
    for bad in (["itl:5"], ["ttft"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)
    assert parse_selected_metrics("ttft, e2el") == ["ttft", "e2el"]
    with pytest.raises(ValueError):
        parse_selected_metrics("ttft,foo")
    assert parse_percentiles("50,99.9") == [50.0, 99.9]
    with pytest.raises(ValueError):
        parse_percentiles("0,50")

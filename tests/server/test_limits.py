"""Work a request may cause before it is rejected is bounded: the body size (413 while it is
read, before parsing) and the prompt length (400 on a characters-per-token bound, before
tokenizing), and the bound never rejects a prompt that fits."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.model.tiny_models import make_tiny_tokenizer
from tests.server.helpers import MODEL, client
from tokenweir.engine.client import ModelInfo
from tokenweir.server.errors import APIError
from tokenweir.server.prompt_bound import max_chars_per_token, min_num_tokens
from tokenweir.server.protocol import ChatCompletionRequest, CompletionRequest
from tokenweir.server.translate import RequestTranslator

LIMIT = 2048


def body_of_size(size: int) -> bytes:
    """A valid completion request of exactly `size` bytes (JSON padded with spaces)."""
    raw = json.dumps({"model": MODEL, "prompt": "hello world", "max_tokens": 2}).encode()
    assert len(raw) <= size
    return raw[:-1] + b" " * (size - len(raw)) + b"}"


def post_raw(url: str, content, headers=None) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", content=content, timeout=60,
                      headers={"Content-Type": "application/json", **(headers or {})})


def assert_413(response: httpx.Response) -> None:
    assert response.status_code == 413, response.text
    error = response.json()["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert str(LIMIT) in error["message"]


def test_body_at_the_limit_is_served(make_server):
    url = make_server(max_request_body_bytes=LIMIT)
    response = post_raw(url, body_of_size(LIMIT))
    assert response.status_code == 200, response.text


def test_body_over_the_limit_is_refused_by_its_length(make_server):
    url = make_server(max_request_body_bytes=LIMIT)
    assert_413(post_raw(url, body_of_size(LIMIT + 1)))
    assert client(url).completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def test_chunked_body_over_the_limit_is_refused_while_it_arrives(make_server):
    url = make_server(max_request_body_bytes=LIMIT)
    body = body_of_size(4 * LIMIT)

    def chunks():  # no Content-Length: the middleware counts what arrives
        for i in range(0, len(body), 512):
            yield body[i:i + 512]

    assert_413(post_raw(url, chunks()))


def test_the_body_limit_runs_after_the_api_key(make_server):
    url = make_server(api_key="k", max_request_body_bytes=LIMIT)
    assert post_raw(url, body_of_size(LIMIT + 1)).status_code == 401
    assert_413(post_raw(url, body_of_size(LIMIT + 1), headers={"Authorization": "Bearer k"}))


# ---------------------------------------------------------------- characters per token

@pytest.fixture(scope="module")
def smollm_tokenizer():
    """The default model's tokenizer (byte-level BPE), without loading its weights."""
    from transformers import AutoTokenizer

    from tokenweir.model.gguf_conversion import ensure_hf_folder
    from tokenweir.model.loader import default_model_path

    return AutoTokenizer.from_pretrained(ensure_hf_folder(default_model_path()))


def test_the_bound_is_the_longest_token(smollm_tokenizer):
    n = max_chars_per_token(smollm_tokenizer)
    vocab = smollm_tokenizer.get_vocab()
    longest = max(vocab, key=len)
    assert n == len(longest)
    # It is reached: the longest token's text is n characters and one token, so no smaller
    # bound holds.
    text = smollm_tokenizer.convert_tokens_to_string([longest])
    assert len(text) == n and smollm_tokenizer.encode(text, add_special_tokens=False) == [vocab[longest]]


def test_tokenizers_that_drop_characters_have_no_bound():
    # Word-level with whitespace splitting: "a      b" is 2 tokens, `<unk>` stands for any word.
    assert max_chars_per_token(make_tiny_tokenizer()) is None


# Any text, and texts built from the pieces that tokenize densest (special tokens, long words,
# whitespace runs, multi-byte characters).
PIECES = ["<|im_start|>", "<|im_end|>", " the", "ing", "😀", "é", "      ", "\n\n", "1234", "="]
TEXT = st.text(max_size=400) | st.lists(st.sampled_from(PIECES), max_size=200).map("".join)


@pytest.fixture(scope="module")
def smollm_bound(smollm_tokenizer):
    return max_chars_per_token(smollm_tokenizer)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(text=TEXT)
def test_the_bound_never_overestimates(smollm_tokenizer, smollm_bound, text):
    n = smollm_bound
    try:
        ids = smollm_tokenizer.encode(text, add_special_tokens=False)
    except TypeError:  # a lone surrogate: rejected as untokenizable before any length check
        return
    assert len(ids) >= min_num_tokens(len(text), n)


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(smollm_tokenizer, monkeypatch):
    n = max_chars_per_token(smollm_tokenizer)
    translator = RequestTranslator(ModelInfo("m", max_model_len=512, vocab_size=49152), smollm_tokenizer)
    calls = []
    encode = smollm_tokenizer.encode
    monkeypatch.setattr(smollm_tokenizer, "encode", lambda *a, **k: calls.append(a) or encode(*a, **k))
    with pytest.raises(APIError) as refused:
        asyncio.run(translator.completion(CompletionRequest(prompt="x" * (n * 512))))
    assert refused.value.status == 400 and refused.value.info.param == "prompt"
    assert "at least 512 tokens" in str(refused.value) and calls == []
    with pytest.raises(APIError) as refused:
        chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x" * (n * 512)}])
        asyncio.run(translator.chat(chat))
    assert refused.value.info.param == "messages" and calls == []
    # Below the bound, the prompt is tokenized, then checked by its exact length.
    with pytest.raises(APIError) as refused:
        asyncio.run(translator.completion(CompletionRequest(prompt="x" * (n * 511))))
    assert len(calls) == 1 and f"has {len(encode('x' * (n * 511)))} tokens" in str(refused.value)


def _raw_request(url: str, head: str, body: bytes, wait_s: float) -> bytes:
    """Send a request's head and part of its body on a raw socket; what came back within wait_s:
    the whole answer once its head is in, to its Content-Length (a busy machine may deliver the
    head and the body in separate reads)."""
    import re
    import socket
    from urllib.parse import urlparse

    where = urlparse(url)
    answer = b""
    with socket.create_connection((where.hostname, where.port), timeout=wait_s) as sock:
        sock.sendall(head.encode() + body)
        try:
            while chunk := sock.recv(65536):
                answer += chunk
                head_end = answer.find(b"\r\n\r\n")
                length = re.search(rb"(?im)^content-length: *(\d+)", answer[:head_end]) if head_end >= 0 else None
                if length and len(answer) >= head_end + 4 + int(length.group(1)):
                    break
        except TimeoutError:
            pass
    return answer


def test_a_body_that_stops_arriving_is_answered_408_and_other_paths_buffer_none(make_server, monkeypatch):
    from tokenweir.server import body_limit

    monkeypatch.setattr(body_limit, "BODY_TIMEOUT_S", 1.0)
    url = make_server(max_request_body_bytes=LIMIT)
    partial = "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n".format(LIMIT)
    answer = _raw_request(url, f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{partial}", b'{"prompt": "', 10)
    assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer, answer[:200]
    # A path no route reads a body for answers at once: nothing is read ahead and held for it.
    answer = _raw_request(url, f"POST /health HTTP/1.1\r\nHost: x\r\n{partial}", b"x" * 100, 0.5)
    assert answer.startswith(b"HTTP/1.1 405"), answer[:200]
    assert client(url).completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens >= 1

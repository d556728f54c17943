"""Bad input gets OpenAI's error JSON with a 4xx naming the field, and the server keeps serving."""

from __future__ import annotations

import argparse
import asyncio

import httpx
import openai
import pytest

from tests.model.tiny_models import VOCAB_SIZE
from tests.server.conftest import MAX_MODEL_LEN
from tests.server.helpers import MODEL, client, post
from tokenweir.server.errors import APIError
from tokenweir.server.protocol import CompletionRequest
from tokenweir.server.translate import RequestTranslator

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hello"}]
LONG = "the " * (MAX_MODEL_LEN + 10)
HALF = "the " * (MAX_MODEL_LEN // 2)

# (id, path, body, status, param the error must name)
CASES = [
    ("wrong-type-temperature", COMPLETIONS, {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("wrong-type-max-tokens", COMPLETIONS, {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("wrong-type-stop", COMPLETIONS, {"prompt": "hi", "stop": 5}, 400, "stop"),
    ("wrong-type-prompt", COMPLETIONS, {"prompt": {"text": "hi"}}, 400, "prompt"),
    ("missing-prompt", COMPLETIONS, {"max_tokens": 3}, 400, "prompt"),
    ("unknown-model", COMPLETIONS, {"prompt": "hi", "model": "gpt-17"}, 404, "model"),
    ("empty-prompt", COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    ("prompt-too-long", COMPLETIONS, {"prompt": LONG}, 400, "prompt"),
    ("prompt-plus-output-too-long", COMPLETIONS, {"prompt": HALF, "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("out-of-vocab-ids", COMPLETIONS, {"prompt": [1, 2, 99999]}, 400, "prompt"),
    ("batched-prompts", COMPLETIONS, {"prompt": ["a", "b"]}, 400, "prompt"),
    ("max-tokens-zero", COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("max-tokens-negative", COMPLETIONS, {"prompt": "hi", "max_tokens": -3}, 400, "max_tokens"),
    ("temperature-negative", COMPLETIONS, {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("top-p-zero", COMPLETIONS, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("top-p-above-one", COMPLETIONS, {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("top-k-negative", COMPLETIONS, {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ("min-tokens-above-max", COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "min_tokens": 5}, 400, "min_tokens"),
    ("logprobs-too-many", COMPLETIONS, {"prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    ("n-two", COMPLETIONS, {"prompt": "hi", "n": 2}, 400, "n"),
    ("echo", COMPLETIONS, {"prompt": "hi", "echo": True}, 400, "echo"),
    ("deadline-negative", COMPLETIONS, {"prompt": "hi", "deadline_ms": -1}, 400, "deadline_ms"),
    # Python's JSON parser reads Infinity and NaN; deadlines and SLOs must be finite.
    ("deadline-infinite", COMPLETIONS, {"prompt": "hi", "deadline_ms": float("inf")}, 400, "deadline_ms"),
    ("ttft-slo-nan", COMPLETIONS, {"prompt": "hi", "ttft_slo_ms": float("nan")}, 400, "ttft_slo_ms"),
    ("tpot-slo-zero", CHAT, {"messages": MESSAGES, "tpot_slo_ms": 0}, 400, "tpot_slo_ms"),
    # Positive in milliseconds, 0.0 in seconds (where the C kernels flush subnormals in the
    # server's threads, already 0 in the schema's check): named as the body spells it.
    ("deadline-underflows", COMPLETIONS, {"prompt": "hi", "deadline_ms": 5e-324}, 400, "deadline_ms"),
    ("priority-above-int32", COMPLETIONS, {"prompt": "hi", "priority": 2**31}, 400, "priority"),
    ("priority-below-int32", CHAT, {"messages": MESSAGES, "priority": -(2**31) - 1}, 400, "priority"),
    ("cache-salt-empty", COMPLETIONS, {"prompt": "hi", "cache_salt": ""}, 400, "cache_salt"),
    ("tenant-too-long", COMPLETIONS, {"prompt": "hi", "tenant": "t" * 257}, 400, "tenant"),
    # Stop conditions are checked after every token: bounded in number and length.
    ("too-many-stop-strings", COMPLETIONS, {"prompt": "hi", "stop": [f"s{i}" for i in range(257)]}, 400, "stop"),
    ("stop-string-too-long", CHAT, {"messages": MESSAGES, "stop": "x" * 1025}, 400, "stop"),
    ("too-many-stop-ids", COMPLETIONS, {"prompt": "hi", "stop_token_ids": list(range(1025))}, 400,
     "stop_token_ids"),
    ("chat-missing-messages", CHAT, {"max_tokens": 3}, 400, "messages"),
    ("chat-empty-messages", CHAT, {"messages": []}, 400, "messages"),
    ("chat-bad-message", CHAT, {"messages": [{"content": "no role"}]}, 400, "messages.0.role"),
    # Only the roles the chat template knows; another would be rendered raw into the prompt.
    ("chat-unknown-role", CHAT, {"messages": [*MESSAGES, {"role": "wizard", "content": "hi"}]}, 400,
     "messages.1.role"),
    ("chat-unknown-model", CHAT, {"messages": MESSAGES, "model": "gpt-17"}, 404, "model"),
    ("chat-max-completion-tokens-zero", CHAT, {"messages": MESSAGES, "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("chat-too-long", CHAT, {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ("chat-top-logprobs-without-logprobs", CHAT, {"messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat-top-logprobs-too-many", CHAT, {"messages": MESSAGES, "logprobs": True, "top_logprobs": 30}, 400,
     "top_logprobs"),
    ("chat-temperature-negative", CHAT, {"messages": MESSAGES, "temperature": -1}, 400, "temperature"),
    ("chat-n-two", CHAT, {"messages": MESSAGES, "n": 2}, 400, "n"),
    # Valid JSON ("\ud800") but no text the tokenizer can encode.
    ("lone-surrogate", COMPLETIONS, {"prompt": "hi \ud800"}, 400, "prompt"),
    ("chat-lone-surrogate", CHAT, {"messages": [{"role": "user", "content": "hi \ud800"}]}, 400, "messages"),
    # ... quoted back in the error message, which must still encode as UTF-8 (it was a 500).
    ("model-lone-surrogate", COMPLETIONS, {"prompt": "hi", "model": "m\ud800"}, 404, "model"),
    ("chat-model-lone-surrogate", CHAT, {"messages": MESSAGES, "model": "\udfff"}, 404, "model"),
    # The engine's check against the vocabulary names the field, not the prompt.
    ("stop-id-out-of-vocab", COMPLETIONS, {"prompt": "hi", "stop_token_ids": [VOCAB_SIZE]}, 400, "stop_token_ids"),
    ("chat-stop-id-out-of-vocab", CHAT, {"messages": MESSAGES, "stop_token_ids": [VOCAB_SIZE + 7]}, 400,
     "stop_token_ids"),
    ("logit-bias-out-of-vocab", COMPLETIONS, {"prompt": "hi", "logit_bias": {str(VOCAB_SIZE): 1}}, 400,
     "logit_bias"),
    ("logit-bias-range", CHAT, {"messages": MESSAGES, "logit_bias": {"40": 100.5}}, 400, "logit_bias.40"),
    ("logit-bias-key", COMPLETIONS, {"prompt": "hi", "logit_bias": {"-4": 1}}, 400, "logit_bias"),
    ("presence-penalty", COMPLETIONS, {"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("frequency-penalty", CHAT, {"messages": MESSAGES, "frequency_penalty": -3}, 400, "frequency_penalty"),
    ("repetition-penalty", COMPLETIONS, {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    # Fields that would change the output in a way the engine does not do: refused, not ignored.
    ("best-of", COMPLETIONS, {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("suffix", COMPLETIONS, {"prompt": "hi", "suffix": "!"}, 400, "suffix"),
    ("response-format-json", CHAT, {"messages": MESSAGES, "response_format": {"type": "json_object"}}, 400,
     "response_format"),
    ("tools", CHAT, {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tools"),
    ("tool-choice-required", CHAT, {"messages": MESSAGES, "tool_choice": "required"}, 400, "tool_choice"),
    ("guided-json", COMPLETIONS, {"prompt": "hi", "guided_json": {"type": "object"}}, 400, "guided_json"),
    ("beam-search", COMPLETIONS, {"prompt": "hi", "use_beam_search": True}, 400, "use_beam_search"),
    ("stream-options-without-stream", COMPLETIONS, {"prompt": "hi", "stream_options": {"include_usage": True}},
     400, "stream_options"),
]


# Bodies as OpenAI's clients and frameworks send them: null for an argument given as None, and
# the values of the refused fields that ask for nothing. Served as if the field were absent.
AS_DEFAULT = [
    (COMPLETIONS, {"n": None, "stream": None, "echo": None, "logprobs": None, "best_of": None, "suffix": None,
                   "ignore_eos": None, "min_tokens": None, "include_stop_str_in_output": None,
                   "skip_special_tokens": None, "priority": None, "stream_options": None}),
    (COMPLETIONS, {"presence_penalty": 0.0, "frequency_penalty": 0, "repetition_penalty": 1.0, "logit_bias": {},
                   "best_of": 1, "suffix": "", "echo": False, "response_format": {"type": "text"}}),
    (CHAT, {"n": None, "stream": None, "logprobs": None, "tools": None, "tool_choice": None,
            "presence_penalty": None, "logit_bias": None}),
    (CHAT, {"tools": [], "tool_choice": "none", "presence_penalty": 0, "frequency_penalty": 0.0}),
    (CHAT, {"tool_choice": "auto", "function_call": "none", "functions": []}),
]


@pytest.mark.parametrize("path,extra", AS_DEFAULT)
def test_null_and_asking_for_nothing_serve_as_the_default(server, path, extra):
    base = {"model": MODEL, "max_tokens": 3, "temperature": 0}
    base.update({"prompt": "hello"} if path == COMPLETIONS else {"messages": MESSAGES})
    plain = post(server, path, base)
    response = post(server, path, {**base, **extra})
    assert plain.status_code == response.status_code == 200, response.text
    key = "text" if path == COMPLETIONS else "message"
    assert response.json()["choices"][0][key] == plain.json()["choices"][0][key]
    assert response.headers["content-type"] == "application/json"  # stream: null is not streaming


def assert_serves(url: str) -> None:
    out = client(url).completions.create(model=MODEL, prompt="hello", max_tokens=2, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 2


@pytest.mark.parametrize("path,body,status,param", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_names_the_field(server, path, body, status, param):
    response = post(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param
    assert param in error["message"]
    assert error["type"] == "invalid_request_error"
    if status == 404:
        assert error["code"] == "model_not_found"
    assert_serves(server)


@pytest.mark.parametrize("raw", [b'{"prompt": "hi",', b"[1, 2]", b"not json at all"])
def test_invalid_json(server, raw):
    response = httpx.post(f"{server}{COMPLETIONS}", content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and "JSON" in error["message"]
    assert_serves(server)


# Errors Starlette or FastAPI raise before a route runs: (id, method, path, raw body, status).
FRAMEWORK_CASES = [
    ("invalid-utf8", "POST", COMPLETIONS, b'{"prompt": "hi \xff\xfe"}', 400),
    ("nested-too-deep", "POST", COMPLETIONS, b"[" * 100000, 400),
    ("unknown-route", "POST", "/v1/nowhere", b"{}", 404),
    ("wrong-method", "GET", COMPLETIONS, b"", 405),
]


@pytest.mark.parametrize("method,path,raw,status", [c[1:] for c in FRAMEWORK_CASES],
                         ids=[c[0] for c in FRAMEWORK_CASES])
def test_framework_errors_in_openai_shape(server, method, path, raw, status):
    response = httpx.request(method, f"{server}{path}", content=raw,
                             headers={"Content-Type": "application/json"}, timeout=60)
    assert response.status_code == status, response.text
    assert set(response.json()) == {"error"}
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] is None
    assert f"{method} {path}" in error["message"]
    if status == 405:
        assert response.headers["Allow"] == "POST"
    assert_serves(server)


def test_parse_failure_says_why(server):
    raw = b'{"prompt": "hi \xff"}'
    response = httpx.post(f"{server}{COMPLETIONS}", content=raw, headers={"Content-Type": "application/json"})
    assert "can't decode byte 0xff" in response.json()["error"]["message"]


def test_unexpected_error_is_a_500_in_openai_shape(server, engine, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("tokenizer on fire")

    monkeypatch.setattr(engine.tokenizer, "encode", broken)
    response = post(server, COMPLETIONS, {"prompt": "hi"})
    assert response.status_code == 500
    assert response.json()["error"] == {"message": "tokenizer on fire", "type": "server_error",
                                        "param": None, "code": "internal_error"}
    monkeypatch.undo()
    assert_serves(server)


def test_openai_client_raises_typed_errors(server):
    c = client(server)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        c.completions.create(model=MODEL, prompt="hi", temperature=-1)
    with pytest.raises(openai.NotFoundError, match="gpt-17"):
        c.chat.completions.create(model="gpt-17", messages=MESSAGES)


def test_api_key(make_server):
    url = make_server(api_key="sekret")
    body = {"prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
        response = post(url, COMPLETIONS, body, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/v1/models").status_code == 401
    # RFC 7235: the scheme is case-insensitive; the key is not.
    for scheme in ("Bearer", "bearer", "BEARER"):
        assert post(url, COMPLETIONS, body, headers={"Authorization": f"{scheme} sekret"}).status_code == 200
    assert post(url, COMPLETIONS, body, headers={"Authorization": "Bearer SEKRET"}).status_code == 401
    # Probes need no key; /metrics does (its prefix-cache counters tell about other users).
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 401
    assert httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer sekret"}).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        client(url, api_key="wrong").models.list()
    assert [m.id for m in client(url, api_key="sekret").models.list().data] == [MODEL]


def test_an_empty_or_unsendable_api_key_is_refused_not_ignored(make_server, engine):
    # `--api-key "$UNSET"` passed "" and turned authentication off without a word.
    from tokenweir.server.app import build_app

    for key in ("", " padded ", "a\nb", "clé"):
        with pytest.raises(ValueError, match=r"^api_key \(--api-key\) must be a non-empty bearer token"):
            build_app(engine, api_key=key)
    from tokenweir.server.args import add_server_args

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--api-key", ""])
    # The schema and its viewers are guarded like /v1/models (they show the model's limits).
    url = make_server(api_key="sekret")
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert httpx.get(f"{url}{path}").status_code == 401, path
        assert httpx.get(f"{url}{path}", headers={"Authorization": "Bearer sekret"}).status_code == 200, path


def test_metrics_can_be_left_open_for_scrapers(make_server):
    url = make_server(api_key="sekret", metrics_require_api_key=False)
    assert httpx.get(f"{url}/metrics").status_code == 200
    assert httpx.get(f"{url}/v1/models").status_code == 401


def test_models_do_not_disclose_local_paths(server, tiny_model_dir):
    text = httpx.get(f"{server}/v1/models").text
    assert MODEL in text
    assert tiny_model_dir("llama") not in text and "/" not in text


@pytest.mark.parametrize("hint,value,param", [("deadline_ms", -1.0, "deadline_ms"), ("ttft_slo_ms", 0.0, "ttft_slo_ms"),
                                              ("tpot_slo_ms", -2.0, "tpot_slo_ms"), ("priority", 2**40, "priority")])
def test_scheduling_hint_errors_name_the_body_field(engine, hint, value, param):
    """SchedulingHints names its own fields (deadline, ttft_slo, ...); the server answers with
    the body's names. The body skips the schema's checks here, so SchedulingHints' own run."""
    translator = RequestTranslator(engine.model_info, engine.tokenizer)
    body = CompletionRequest.model_construct(prompt="hello world", **{hint: value})
    with pytest.raises(APIError) as refused:
        asyncio.run(translator.completion(body))
    assert refused.value.status == 400 and refused.value.info.param == param
    assert param in str(refused.value)


@pytest.mark.parametrize("path, body, message", [
    # Ids then one string: pydantic's union made an error per element per list shape (a 4 MiB
    # body held the event loop for a minute); checked in one pass, it is one error.
    (COMPLETIONS, {"prompt": list(range(200_000)) + ["x"]}, "prompt[200000] must be a token id"),
    (CHAT, {"messages": [{"role": "bad"}] * 100_000}, "invalid 'messages.0.role': Input should be"),
    (CHAT, {"messages": [{"role": "user", "content": [{}] * 100_000}]},
     "invalid 'messages.0.content': List should have at most 4096"),
])
def test_a_large_bad_body_is_one_error(server, path, body, message):
    response = post(server, path, body)
    assert response.status_code == 400 and message in response.json()["error"]["message"], response.text[:300]
    assert_serves(server)

"""The OpenAPI document says what the server does: OpenAI error JSON (never 422), /health's and
/metrics' bodies, SSE streams, and request schemas that refuse what the server refuses."""

from __future__ import annotations

import httpx
import jsonschema_rs
import pytest

from tests.model.tiny_models import VOCAB_SIZE
from tests.server.conftest import MAX_MODEL_LEN
from tests.server.helpers import MESSAGES_OK, MODEL, post

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@pytest.fixture
def spec(server):
    return httpx.get(f"{server}/openapi.json").json()


def body_validator(spec, path):
    """A validator of `path`'s request body, with the document's components to resolve $refs."""
    ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    return jsonschema_rs.validator_for({**spec["components"]["schemas"][ref.rsplit("/", 1)[1]],
                                        "components": spec["components"]})


def test_no_422_anywhere(spec):
    text = str(spec)
    assert "422" not in spec["paths"][COMPLETIONS]["post"]["responses"]
    assert "HTTPValidationError" not in text and "ValidationError" not in spec["components"]["schemas"]


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
def test_generation_errors_are_openai_errors(spec, path):
    responses = spec["paths"][path]["post"]["responses"]
    assert set(responses) == {"200", "400", "401", "404", "413", "429", "500", "503", "504"}
    for status in ("400", "401", "404", "413", "429", "500", "503", "504"):
        schema = responses[status]["content"]["application/json"]["schema"]
        assert schema == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "Retry-After" in responses["429"]["headers"] and "Retry-After" in responses["503"]["headers"]
    assert set(responses["504"]["headers"]) == {"x-should-retry"}
    assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}


def test_health_and_metrics_are_documented_and_answer_so(server, spec):
    health = spec["paths"]["/health"]["get"]["responses"]
    assert health["200"]["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/HealthResponse"}
    assert "503" in health
    response = httpx.get(f"{server}/health")
    assert response.headers["content-type"] == "application/json" and response.json() == {"status": "ok"}
    metrics = spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    assert list(metrics) == ["text/plain"]
    assert httpx.get(f"{server}/metrics").headers["content-type"].startswith("text/plain")


# Bodies the server refuses with a 400 and the schema must refuse as well.
REFUSED = [
    (COMPLETIONS, {"prompt": ""}),
    (COMPLETIONS, {"prompt": []}),
    (COMPLETIONS, {"prompt": [""]}),
    (COMPLETIONS, {"prompt": [1, 2, VOCAB_SIZE]}),  # the schema knows the served model's vocabulary
    (COMPLETIONS, {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}),  # and its context length
    (COMPLETIONS, {"prompt": "hi", "echo": True}),
    (COMPLETIONS, {"prompt": "hi", "echo": 0}),
    (COMPLETIONS, {"prompt": "hi", "n": 2}),
    (COMPLETIONS, {"prompt": "hi", "stop": ["s"] * 257}),
    (COMPLETIONS, {"prompt": "hi", "priority": 2**31}),
    (CHAT, {"messages": MESSAGES_OK, "top_logprobs": 2}),
    (CHAT, {"messages": MESSAGES_OK, "top_logprobs": 2, "logprobs": False}),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}),
    (CHAT, {"messages": []}),
    # Bounds of fields that take an int or a float (pydantic wrote them in words of its own).
    (COMPLETIONS, {"prompt": "hi", "temperature": -1}),
    (CHAT, {"messages": MESSAGES_OK, "top_p": 1.5}),
    (COMPLETIONS, {"prompt": "hi", "deadline_ms": 0}),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"40": -101}}),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"x": 1}}),
    (COMPLETIONS, {"prompt": "hi", "presence_penalty": 2.5}),
    (CHAT, {"messages": MESSAGES_OK, "repetition_penalty": 0}),
    (COMPLETIONS, {"prompt": "hi", "suffix": "!"}),
    (CHAT, {"messages": MESSAGES_OK, "tools": [{"type": "function"}]}),
    (CHAT, {"messages": MESSAGES_OK, "tool_choice": "required"}),
]
ACCEPTED = [
    (COMPLETIONS, {"prompt": "hi", "echo": False}),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "n": None, "stream": None, "echo": None,
                   "presence_penalty": 0.0, "logit_bias": {}, "best_of": 1}),
    (CHAT, {"messages": MESSAGES_OK, "max_tokens": 2, "logprobs": None, "tools": [], "tool_choice": "none"}),
    (COMPLETIONS, {"prompt": [1, 2, VOCAB_SIZE - 1], "max_tokens": 2}),
    (CHAT, {"messages": MESSAGES_OK, "top_logprobs": 2, "logprobs": True, "max_tokens": 2}),
    (CHAT, {"messages": MESSAGES_OK, "top_logprobs": None, "max_tokens": 2}),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "logit_bias": {"40": -100, "3": 2.5}, "presence_penalty": 0.5,
                   "frequency_penalty": -2, "repetition_penalty": 1.2}),
    (CHAT, {"messages": [{"role": r, "content": "hi"} for r in ("system", "user", "assistant", "tool", "user")],
            "max_tokens": 2}),
]


@pytest.mark.parametrize("path,body", REFUSED)
def test_schema_and_server_refuse_alike(server, spec, path, body):
    assert not body_validator(spec, path).is_valid(body)
    assert post(server, path, {"model": MODEL, **body}).status_code == 400


@pytest.mark.parametrize("path,body", ACCEPTED)
def test_schema_and_server_accept_alike(server, spec, path, body):
    assert body_validator(spec, path).is_valid(body)
    assert post(server, path, {"model": MODEL, **body}).status_code == 200

"""The OpenAPI document's account of the answers: every error as OpenAI's error JSON (never
FastAPI's 422 HTTPValidationError), SSE streams event by event, /metrics as Prometheus text,
and request schemas bounded by the served model where JSON Schema can say it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from tokenweir.engine.client import ModelInfo
from tokenweir.server.protocol import ChatCompletionResponse, CompletionResponse, ErrorResponse

_ERROR_MEANINGS = {
    400: "invalid request (`param` names the field)",
    401: "missing or wrong API key (with --api-key)",
    404: "unknown model",
    413: "request body larger than --max-request-body-bytes",
    429: "too many requests waiting (--max-waiting-requests); retry after Retry-After",
    500: "the engine failed this request",
    503: "the engine is not running (`engine_dead`), or, from /health, has made no progress for "
         "--engine-hang-timeout seconds with requests to serve (`engine_stalled`); retry after Retry-After",
    504: "its `deadline_ms` passed before it finished (--sla-drop-expired), or the step cost model says it "
         "cannot be met (--sla-drop-unmeetable; the message says what it needs and what was left); retrying "
         "cannot help",
}
# One server-sent event (OpenAPI 3.1 has a stream's `schema` describe each event): `data` is a
# chunk of the response as JSON, an error object, or `[DONE]`.
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "string"}}}
# The openai clients' own header: without it they retry a 5xx.
_NO_RETRY = {"x-should-retry": {"description": "`false`: retrying cannot help", "schema": {"type": "string"}}}
_HEADERS = {429: _RETRY_AFTER, 503: _RETRY_AFTER, 504: _NO_RETRY}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": ErrorResponse, "description": _ERROR_MEANINGS[s],
                **({"headers": _HEADERS[s]} if s in _HEADERS else {})} for s in statuses}


def _generation_responses(model: type) -> dict[int | str, dict[str, Any]]:
    ok = {"model": model, "description": "the completion; with `stream: true`, server-sent events: "
                                         "`data: <chunk JSON>` lines, then `data: [DONE]`",
          "content": {"text/event-stream": {"schema": _SSE_EVENT}}}
    return {200: ok, **error_responses(400, 401, 404, 413, 429, 500, 503, 504)}


def _cap_integers(node: Any, maximum: int) -> None:
    if isinstance(node, dict):
        if node.get("type") == "integer":
            node["maximum"] = maximum
        for child in node.values():
            _cap_integers(child, maximum)
    elif isinstance(node, list):
        for child in node:
            _cap_integers(child, maximum)


# pydantic writes the bounds of a union of int and float (`Number`) as its own keywords beside
# the `anyOf`, which JSON Schema does not know (so a validator ignored them): these are theirs.
_BOUND_KEYWORDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


def _standard_keywords(node: Any) -> None:
    """Number bounds in JSON Schema's words, and a dict whose keys must match a pattern closed
    to other keys (pydantic refuses them; `patternProperties` alone admits them)."""
    if isinstance(node, dict):
        if "anyOf" in node:
            for ours, standard in _BOUND_KEYWORDS.items():
                if isinstance(node.get(ours), (int, float)):
                    node[standard] = node.pop(ours)
        if "patternProperties" in node:
            node.setdefault("additionalProperties", False)
        for child in node.values():
            _standard_keywords(child)
    elif isinstance(node, list):
        for child in node:
            _standard_keywords(child)


def _bound_by_model(schemas: dict[str, Any], model: ModelInfo) -> None:
    """What the schema can say about the served model: prompt token ids below its vocabulary
    size, output lengths below max_model_len (the rest of the length rule needs the prompt's
    token count, known only after tokenizing). Chat's `max_tokens` stays open: the server
    ignores it when `max_completion_tokens` is set."""
    _cap_integers(schemas["CompletionRequest"]["properties"]["prompt"], model.vocab_size - 1)
    for name, field in (("CompletionRequest", "max_tokens"), ("ChatCompletionRequest", "max_completion_tokens")):
        _cap_integers(schemas[name]["properties"][field], model.max_model_len - 1)


def build_openapi(app: FastAPI, model: ModelInfo) -> dict[str, Any]:
    """FastAPI's document without the 422 HTTPValidationError it adds to every route with a
    body (validation errors are answered as OpenAI 400s, errors.py), bounded by the model."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for operations in schema["paths"].values():
            for operation in operations.values():
                operation["responses"].pop("422", None)
        components = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        _standard_keywords(components)
        _bound_by_model(components, model)
        app.openapi_schema = schema
    return app.openapi_schema


COMPLETION_RESPONSES = _generation_responses(CompletionResponse)
CHAT_RESPONSES = _generation_responses(ChatCompletionResponse)
METRICS_RESPONSES = {200: {"description": "Prometheus text exposition format",
                           "content": {"text/plain": {"schema": {"type": "string"}}}}, **error_responses(401)}

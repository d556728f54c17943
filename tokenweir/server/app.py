"""The OpenAI-compatible HTTP app: routes, middleware and the OpenAPI document, wired around
one `EngineClient`. /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics,
/version, and /openapi.json describing exactly these answers.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Optional

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import tokenweir
from tokenweir.config import EngineArgs
from tokenweir.engine.async_engine import EngineDeadError
from tokenweir.engine.client import EngineClient, ModelInfo
from tokenweir.server.auth import APIKeyMiddleware, guarded_paths
from tokenweir.server.body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES, BodySizeLimitMiddleware
from tokenweir.server.errors import engine_error, install_error_handlers
from tokenweir.server.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                       CompletionResponse, ErrorResponse, HealthResponse, ModelList,
                                       VersionResponse)
from tokenweir.server.serving import OpenAIServing

_ERROR_MEANINGS = {
    400: "invalid request (`param` names the field)",
    401: "missing or wrong API key (with --api-key)",
    404: "unknown model",
    413: "request body larger than --max-request-body-bytes",
    429: "too many requests waiting (--max-waiting-requests); retry after Retry-After",
    500: "the engine failed this request",
    503: "the engine is not running; retry after Retry-After",
}
# One server-sent event (OpenAPI 3.1 has a stream's `schema` describe each event): `data` is a
# chunk of the response as JSON, an error object, or `[DONE]`.
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
_RETRY_AFTER = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "string"}}}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {s: {"model": ErrorResponse, "description": _ERROR_MEANINGS[s],
                **({"headers": _RETRY_AFTER} if s in (429, 503) else {})} for s in statuses}


def _generation_responses(model: type) -> dict[int | str, dict[str, Any]]:
    ok = {"model": model, "description": "the completion; with `stream: true`, server-sent events: "
                                         "`data: <chunk JSON>` lines, then `data: [DONE]`",
          "content": {"text/event-stream": {"schema": _SSE_EVENT}}}
    return {200: ok, **_errors(400, 401, 404, 413, 429, 500, 503)}


def _cap_integers(node: Any, maximum: int) -> None:
    if isinstance(node, dict):
        if node.get("type") == "integer":
            node["maximum"] = maximum
        for child in node.values():
            _cap_integers(child, maximum)
    elif isinstance(node, list):
        for child in node:
            _cap_integers(child, maximum)


def _bound_by_model(schemas: dict[str, Any], model: ModelInfo) -> None:
    """What the schema can say about the served model: prompt token ids below its vocabulary
    size, output lengths below max_model_len (the rest of the length rule needs the prompt's
    token count, known only after tokenizing). Chat's `max_tokens` stays open: the server
    ignores it when `max_completion_tokens` is set."""
    _cap_integers(schemas["CompletionRequest"]["properties"]["prompt"], model.vocab_size - 1)
    for name, field in (("CompletionRequest", "max_tokens"), ("ChatCompletionRequest", "max_completion_tokens")):
        _cap_integers(schemas[name]["properties"][field], model.max_model_len - 1)


def _openapi(app: FastAPI, model: ModelInfo) -> dict[str, Any]:
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
        _bound_by_model(components, model)
        app.openapi_schema = schema
    return app.openapi_schema


def build_app(client: EngineClient, *, api_key: Optional[str] = None, max_waiting_requests: Optional[int] = None,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              metrics_require_api_key: bool = True) -> FastAPI:
    """The FastAPI app around a running engine. The app does not own the engine: whoever made
    it shuts it down. With `api_key`, /v1/* (and /metrics unless `metrics_require_api_key` is
    off) need `Authorization: Bearer KEY`."""
    if max_request_body_bytes < 1:
        raise ValueError(f"max_request_body_bytes must be >= 1, got {max_request_body_bytes}")
    serving = OpenAIServing(client, max_waiting_requests)
    model = client.model_info
    created = int(time.time())
    app = FastAPI(title="tokenweir", version=tokenweir.__version__)
    app.state.serving = serving
    install_error_handlers(app)
    app.openapi = lambda: _openapi(app, model)  # type: ignore[method-assign]

    v1 = APIRouter(prefix="/v1")

    @v1.post("/completions", response_model=None, responses=_generation_responses(CompletionResponse))
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await serving.completions(body, raw)

    @v1.post("/chat/completions", response_model=None, responses=_generation_responses(ChatCompletionResponse))
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.chat_completions(body, raw)

    @v1.get("/models", response_model=ModelList, responses=_errors(401))
    async def models() -> dict[str, Any]:
        # Name and limits only: never where the weights lie on this machine.
        card = {"id": model.name, "object": "model", "created": created, "owned_by": "tokenweir",
                "max_model_len": model.max_model_len}
        return {"object": "list", "data": [card]}

    app.include_router(v1)

    @app.get("/health", response_model=HealthResponse, responses=_errors(503))
    async def health() -> Any:
        if not client.is_running:
            return engine_error(EngineDeadError(f"the engine is not running: {client.dead_error}")).response()
        return {"status": "ok"}

    @app.get("/version", response_model=VersionResponse)
    async def version() -> dict[str, str]:
        return {"version": tokenweir.__version__}

    metrics_doc = {200: {"description": "Prometheus text exposition format",
                         "content": {"text/plain": {"schema": {"type": "string"}}}}, **_errors(401)}

    @app.get("/metrics", response_class=Response, responses=metrics_doc)
    async def metrics() -> Response:
        # A plain route: mounting prometheus' ASGI app at /metrics answers with a redirect.
        return Response(generate_latest(client.metrics_registry), media_type=CONTENT_TYPE_LATEST)

    # The last added runs first: the key is checked before a byte of the body is read.
    app.add_middleware(BodySizeLimitMiddleware, limit=max_request_body_bytes)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key, guarded=guarded_paths(metrics_require_api_key))
    return app


def run_server(engine_args: EngineArgs, ns: argparse.Namespace) -> None:
    """`tokenweir serve`: load the model, then serve until interrupted."""
    from tokenweir.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine.from_engine_args(engine_args)
    try:
        app = build_app(engine, api_key=ns.api_key, max_waiting_requests=ns.max_waiting_requests,
                        max_request_body_bytes=ns.max_request_body_bytes,
                        metrics_require_api_key=ns.metrics_require_api_key)
        uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level,
                    access_log=not ns.disable_uvicorn_access_log)
    finally:
        engine.shutdown()

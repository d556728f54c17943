"""The OpenAI-compatible HTTP app: routes and middleware wired around one `EngineClient`.
/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, /version, and
/openapi.json describing exactly these answers (openapi.py).
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Optional

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import tokenweir
from tokenweir.config import EngineArgs
from tokenweir.engine.client import EngineDeadError
from tokenweir.engine.client import EngineClient
from tokenweir.server.auth import APIKeyMiddleware, KeyGrant, check_api_key_options, guarded_paths, load_api_keys
from tokenweir.server.body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES, BodySizeLimitMiddleware
from tokenweir.server.args import DEFAULT_ENGINE_HANG_TIMEOUT_S
from tokenweir.server.errors import engine_error, engine_stalled, install_error_handlers
from tokenweir.server.openapi import (CHAT_RESPONSES, COMPLETION_RESPONSES, METRICS_RESPONSES, build_openapi,
                                      error_responses)
from tokenweir.server.protocol import (ChatCompletionRequest, CompletionRequest, HealthResponse, ModelList,
                                       VersionResponse)
from tokenweir.server.serving import OpenAIServing

# The routes that read a body: the only ones the body limit reads ahead for.
COMPLETIONS_PATH, CHAT_PATH = "/v1/completions", "/v1/chat/completions"
BODY_PATHS = (COMPLETIONS_PATH, CHAT_PATH)


def build_app(client: EngineClient, *, api_key: Optional[str] = None, max_waiting_requests: Optional[int] = None,
              max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
              metrics_require_api_key: bool = True, api_keys: Optional[dict[str, KeyGrant]] = None,
              engine_hang_timeout: float = DEFAULT_ENGINE_HANG_TIMEOUT_S) -> FastAPI:
    """The FastAPI app around a running engine. The app does not own the engine: whoever made
    it shuts it down. With `api_key` or `api_keys` (key -> its grant; not both), /v1/* (and
    /metrics unless `metrics_require_api_key` is off) need `Authorization: Bearer KEY`; a key
    from `api_keys` sets the request's tenant (and bounds its priority if its grant does), and
    those tenants get metric labels of their own. /health answers 503 while the engine has made
    no progress for `engine_hang_timeout` seconds with requests to serve (0: never)."""
    check_api_key_options(api_key, api_keys)
    if max_request_body_bytes < 1:
        raise ValueError(f"max_request_body_bytes must be >= 1, got {max_request_body_bytes}")
    serving = OpenAIServing(client, max_waiting_requests)
    model = client.model_info
    created = int(time.time())
    app = FastAPI(title="tokenweir", version=tokenweir.__version__)
    app.state.serving = serving
    install_error_handlers(app)
    app.openapi = lambda: build_openapi(app, model)  # type: ignore[method-assign]

    v1 = APIRouter(prefix="/v1")

    @v1.post(COMPLETIONS_PATH.removeprefix("/v1"), response_model=None, responses=COMPLETION_RESPONSES)
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await serving.completions(body, raw)

    @v1.post(CHAT_PATH.removeprefix("/v1"), response_model=None, responses=CHAT_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.chat_completions(body, raw)

    @v1.get("/models", response_model=ModelList, responses=error_responses(401))
    async def models() -> dict[str, Any]:
        # Name and limits only: never where the weights lie on this machine.
        card = {"id": model.name, "object": "model", "created": created, "owned_by": "tokenweir",
                "max_model_len": model.max_model_len}
        return {"object": "list", "data": [card]}

    app.include_router(v1)

    @app.get("/health", response_model=HealthResponse, responses=error_responses(503))
    async def health() -> Any:
        if not client.is_running:
            return engine_error(EngineDeadError(f"the engine is not running: {client.dead_error}")).response()
        stalled = client.stalled_seconds()
        if engine_hang_timeout and stalled is not None and stalled > engine_hang_timeout:
            return engine_stalled(stalled, engine_hang_timeout).response()
        return {"status": "ok"}

    @app.get("/version", response_model=VersionResponse)
    async def version() -> dict[str, str]:
        return {"version": tokenweir.__version__}

    @app.get("/metrics", response_class=Response, responses=METRICS_RESPONSES)
    async def metrics() -> Response:
        # A plain route: mounting prometheus' ASGI app at /metrics answers with a redirect.
        return Response(generate_latest(client.metrics_registry), media_type=CONTENT_TYPE_LATEST)

    # The last added runs first: the key is checked before a byte of the body is read.
    app.add_middleware(BodySizeLimitMiddleware, limit=max_request_body_bytes, paths=BODY_PATHS)
    keys: dict[str, Optional[KeyGrant]] = dict(api_keys or {})
    if api_key is not None:  # checked above: never empty
        keys[api_key] = None
    if api_keys:
        client.reserve_tenant_labels([grant.tenant for grant in api_keys.values()])
    if keys:
        app.add_middleware(APIKeyMiddleware, api_keys=keys, guarded=guarded_paths(metrics_require_api_key))
    return app


def run_server(engine_args: EngineArgs, ns: argparse.Namespace) -> None:
    """`tokenweir serve`: load the model, then serve until interrupted."""
    from tokenweir.cluster.config import cluster_config_from
    from tokenweir.engine.async_engine import AsyncLLMEngine
    from tokenweir.engine.core_process import MPAsyncLLMEngine
    from tokenweir.engine.gc_heap import freeze_startup_heap
    from tokenweir.engine.step_trace import StepTrace

    api_keys = load_api_keys(ns.api_keys_file) if ns.api_keys_file is not None else None  # before the load
    step_trace = None
    engine: AsyncLLMEngine
    cluster = cluster_config_from(ns)
    if cluster.data_parallel_size > 1:
        from tokenweir.cluster.coordinator import ClusterEngine

        if ns.engine_in_process or ns.step_trace:
            raise SystemExit("--data-parallel-size > 1 runs each engine in a replica of its own: "
                             "--engine-in-process and --step-trace apply to a single engine")
        engine = ClusterEngine(engine_args, cluster)
    elif ns.engine_in_process:
        step_trace = StepTrace(ns.step_trace) if ns.step_trace else None
        engine = AsyncLLMEngine.from_engine_args(engine_args, step_trace)
        if step_trace is not None:
            step_trace.write_header(engine.core.describe())
        freeze_startup_heap()  # this process holds its one engine until it exits
    else:  # the engine process writes the step trace itself
        engine = MPAsyncLLMEngine(engine_args, step_trace_path=ns.step_trace)
    try:
        app = build_app(engine, api_key=ns.api_key, max_waiting_requests=ns.max_waiting_requests,
                        max_request_body_bytes=ns.max_request_body_bytes,
                        metrics_require_api_key=ns.metrics_require_api_key, api_keys=api_keys,
                        engine_hang_timeout=ns.engine_hang_timeout)
        uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level,
                    access_log=not ns.disable_uvicorn_access_log)
    finally:
        engine.shutdown()
        if step_trace is not None:
            step_trace.close()

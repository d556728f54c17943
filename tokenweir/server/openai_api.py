"""The OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models,
/health, /metrics, /version.

Requests are validated here and tokenized in worker threads (a huge prompt takes seconds, and
the event loop must keep other streams flowing), then handed to AsyncLLMEngine. Every error is
answered in OpenAI's JSON shape: one a client can cause with a 4xx (naming the field where there
is one), an engine failure with a 500 (or, mid-stream, an SSE error event); an overloaded server
answers 429 with Retry-After. A client that disconnects aborts its request, freeing its KV blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncGenerator, AsyncIterator, Optional

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

import tokenweir
from tokenweir.config import EngineArgs
from tokenweir.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestFailedError
from tokenweir.engine.output import RequestOutput
from tokenweir.request import ParameterError, SamplingParams
from tokenweir.server.protocol import (ChatCompletionRequest, CompletionRequest, ErrorInfo,
                                       ErrorResponse, GenerationRequest)

RETRY_AFTER_S = 1
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None,
                 type: str = "invalid_request_error", code: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.info).model_dump(), status_code=self.status,
                            headers=self.headers)


def _bad_request(message: str, param: Optional[str]) -> APIError:
    return APIError(400, message, param=param)


def _engine_error(error: Exception) -> APIError:
    if isinstance(error, EngineDeadError):
        return APIError(503, str(error), type="server_error", code="engine_dead",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    return APIError(500, str(error), type="server_error", code="internal_error")


def _validation_error(exc: RequestValidationError) -> APIError:
    """The first pydantic error, as a 400 naming the field."""
    err = exc.errors()[0]
    loc = [str(part) for part in err.get("loc", ())]
    if err.get("type") == "json_invalid":
        detail = err.get("ctx", {}).get("error", "")
        where = f" at position {loc[1]}" if len(loc) > 1 else ""
        return _bad_request(f"the request body is not valid JSON: {detail}{where}", None)
    fields = loc[1:] if loc[:1] == ["body"] else loc
    if not fields:
        return _bad_request("the request body must be a JSON object (Content-Type: application/json): "
                            f"{err.get('msg')}", None)
    # pydantic names the union member that failed ('str', 'list[int]'): not a field.
    path = ".".join(f for f in fields if f.isdigit() or f.isidentifier() and f not in _TYPE_TAGS)
    return _bad_request(f"invalid '{path}': {err.get('msg')} (got {err.get('input')!r})", fields[0])


def _http_error(request: Request, exc: HTTPException) -> APIError:
    """Starlette's own errors (unknown route, wrong method, and FastAPI's body that cannot be
    parsed, such as invalid UTF-8 or JSON nested too deeply), in OpenAI's shape."""
    message = f"{exc.detail} ({request.method} {request.url.path})"
    if exc.__cause__ is not None:  # FastAPI keeps why the body could not be parsed only here
        message = f"{message}: {exc.__cause__}"
    type = "server_error" if exc.status_code >= 500 else "invalid_request_error"
    return APIError(exc.status_code, message, type=type, headers=exc.headers)


class _APIKeyMiddleware:
    """Requires `Authorization: Bearer KEY` on /v1/*, before the body is even read.

    A plain ASGI middleware (not BaseHTTPMiddleware) so that streaming and disconnect
    detection pass through untouched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                error = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                                 code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _abort_on_disconnect(request: Request, engine: AsyncLLMEngine, request_id: str) -> None:
    """Abort the request when its client goes away. uvicorn also answers `http.disconnect`
    once the response is complete; the abort of a finished request is a no-op."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    engine.abort(request_id)


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def _usage(output: RequestOutput) -> dict[str, int]:
    prompt, completion = len(output.prompt_token_ids), len(output.outputs[0].token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:k]


def _by_text(token: Any, top: list[tuple[int, float]]) -> dict[str, float]:
    """Completions key top logprobs by token text; where two ids spell the same text, the
    likelier one stays."""
    result: dict[str, float] = {}
    for token_id, lp in top:
        result.setdefault(token(token_id), lp)
    return result


@dataclass
class _Job:
    """One accepted request, and how to answer it."""

    request_id: str
    created: int
    model: str
    chat: bool
    num_logprobs: Optional[int]  # None: no logprobs asked for
    include_usage: bool
    outputs: AsyncGenerator[RequestOutput, None]
    watcher: asyncio.Task[None]


class OpenAIServer:
    """The routes' logic around one engine; `build_app` wires it into FastAPI."""

    def __init__(self, engine: AsyncLLMEngine, max_waiting_requests: Optional[int]) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_waiting_requests = max_waiting_requests
        self.created = int(time.time())

    # ------------------------------------------------------------ checks

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.engine.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"`{self.engine.model_name}`.", param="model", code="model_not_found")

    def check_overload(self) -> None:
        if not self.engine.is_running:
            raise _engine_error(EngineDeadError(f"the engine is not running: {self.engine.dead_error}"))
        limit = self.max_waiting_requests
        if limit is not None and self.engine.num_waiting_requests() >= limit:
            raise APIError(429, f"The server is overloaded: {limit} requests are already waiting. "
                                "Retry later.", type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": str(RETRY_AFTER_S)})

    def resolve_max_tokens(self, max_tokens: Optional[int], max_tokens_param: str,
                           prompt_ids: list[int], prompt_param: str) -> int:
        """Check the prompt and output lengths against max_model_len, as vLLM does (400 rather
        than silently clamping); an unset max_tokens fills the rest of the context."""
        if max_tokens is not None and max_tokens < 1:
            raise _bad_request(f"{max_tokens_param} must be at least 1, got {max_tokens}", max_tokens_param)
        n, limit = len(prompt_ids), self.engine.max_model_len
        if n == 0:
            raise _bad_request(f"{prompt_param} is empty: it must contain at least one token", prompt_param)
        if n >= limit:
            raise _bad_request(
                f"This model's maximum context length is {limit} tokens, and `{prompt_param}` has "
                f"{n} tokens, which leaves no room for output. Please shorten `{prompt_param}`.",
                prompt_param)
        if max_tokens is None:
            return limit - n
        if n + max_tokens > limit:
            raise _bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{n + max_tokens} tokens ({n} in `{prompt_param}`, {max_tokens} in "
                f"`{max_tokens_param}`). Please shorten `{prompt_param}` or lower "
                f"`{max_tokens_param}`.", max_tokens_param)
        return max_tokens

    @staticmethod
    def sampling_params(body: GenerationRequest, max_tokens: int, logprobs: Optional[int]) -> SamplingParams:
        try:
            return body.sampling_params(max_tokens, logprobs)
        except ParameterError as e:
            raise _bad_request(str(e), e.param) from e

    # ------------------------------------------------------------ prompts
    # Tokenizing and rendering run in worker threads (asyncio.to_thread). They may overlap: the
    # Rust tokenizer's encode and decode only read it, as long as every call passes the same
    # truncation and padding settings (otherwise transformers changes them first).

    def encode(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        try:
            # The tokenizer rejects a lone surrogate (valid JSON: "\ud800") with a TypeError that
            # does not say why; str.encode names the character and where it is.
            text.encode("utf-8")
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except (TypeError, ValueError) as e:
            raise _bad_request(f"`{param}` cannot be tokenized: {e}", param) from e

    async def completion_prompt(self, body: CompletionRequest) -> tuple[Optional[str], list[int]]:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise _bad_request(f"prompt: batched prompts ({len(prompt)}) are not supported; "
                                   "send one prompt per request", "prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt, await asyncio.to_thread(self.encode, prompt, "prompt", True)
        return None, list(prompt)  # the engine checks the ids against the vocabulary

    def chat_prompt(self, body: ChatCompletionRequest) -> tuple[str, list[int]]:
        messages = [m.for_template() for m in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja errors, a template that rejects a role, no template
            raise _bad_request(f"messages cannot be rendered by the model's chat template: {e}",
                               "messages") from e
        # The template already carries BOS where the model wants one (as LLM.chat does).
        return text, self.encode(text, "messages", add_special_tokens=False)

    # ------------------------------------------------------------ serving

    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        arrival = time.time()
        self.check_model(body.model)
        self.check_overload()
        if body.echo:
            raise _bad_request("echo is not supported", "echo")
        text, ids = await self.completion_prompt(body)
        max_tokens = self.resolve_max_tokens(body.max_tokens, "max_tokens", ids, "prompt")
        params = self.sampling_params(body, max_tokens, body.logprobs)
        job = await self.submit("cmpl", body, raw, text, ids, params, arrival, chat=False)
        return await self.respond(job, body.stream)

    async def chat_completions(self, body: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.time()
        self.check_model(body.model)
        self.check_overload()
        if body.top_logprobs is not None:
            if not body.logprobs:
                raise _bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
            if not 0 <= body.top_logprobs <= 20:
                raise _bad_request(f"top_logprobs must be in [0, 20], got {body.top_logprobs}", "top_logprobs")
        text, ids = await asyncio.to_thread(self.chat_prompt, body)
        if body.max_completion_tokens is not None:
            max_tokens = self.resolve_max_tokens(body.max_completion_tokens, "max_completion_tokens",
                                                 ids, "messages")
        else:
            max_tokens = self.resolve_max_tokens(body.max_tokens, "max_tokens", ids, "messages")
        params = self.sampling_params(body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
        job = await self.submit("chatcmpl", body, raw, text, ids, params, arrival, chat=True)
        return await self.respond(job, body.stream)

    async def submit(self, prefix: str, body: GenerationRequest, raw: Request, text: Optional[str],
                     ids: list[int], params: SamplingParams, arrival: float, chat: bool) -> _Job:
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        try:
            outputs = await self.engine.add_request(request_id, ids, params, body.scheduling_hints(arrival),
                                                    prompt_text=text)
        except ValueError as e:
            raise _bad_request(str(e), "messages" if chat else "prompt") from e
        except (EngineDeadError, RequestFailedError) as e:
            raise _engine_error(e) from e
        watcher = asyncio.create_task(_abort_on_disconnect(raw, self.engine, request_id))
        return _Job(request_id, int(arrival), self.engine.model_name, chat, params.logprobs,
                    body.include_usage, outputs, watcher)

    async def respond(self, job: _Job, stream: bool) -> Response:
        if stream:
            return StreamingResponse(self.stream(job), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return JSONResponse(await self.complete(job))

    def _envelope(self, job: _Job, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        if job.chat:
            obj = "chat.completion.chunk" if chunk else "chat.completion"
        else:
            obj = "text_completion"
        return {"id": job.request_id, "object": obj, "created": job.created, "model": job.model,
                "choices": choices}

    def _logprobs(self, job: _Job, output: RequestOutput, start: int, text_offset: int) -> Any:
        """Logprobs of tokens [start:] in OpenAI's format for the endpoint."""
        completion = output.outputs[0]
        if job.num_logprobs is None or completion.logprobs is None:
            return None
        ids = completion.token_ids[start:]
        # The engine thread keeps appending to this list (outputs share it): stop at this
        # output's own tokens.
        entries = completion.logprobs[start:len(completion.token_ids)]
        k = job.num_logprobs
        token = self._token_text
        if job.chat:
            return {"content": [
                {"token": token(t), "logprob": entry[t], "bytes": list(token(t).encode()),
                 "top_logprobs": [{"token": token(i), "logprob": lp, "bytes": list(token(i).encode())}
                                  for i, lp in _top(entry, k)]}
                for t, entry in zip(ids, entries)]}
        strings = [token(t) for t in ids]
        offsets = []
        for s in strings:
            offsets.append(text_offset)
            text_offset += len(s)
        return {"tokens": strings, "token_logprobs": [entry[t] for t, entry in zip(ids, entries)],
                "top_logprobs": [_by_text(token, _top(entry, k)) for entry in entries],
                "text_offset": offsets}

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _choice(self, job: _Job, output: RequestOutput, text: str, logprobs: Any,
                chunk: bool, opening: bool = False) -> dict[str, Any]:
        """One choice; `opening` marks a chat stream's first chunk, which names the role."""
        completion = output.outputs[0]
        finish = completion.finish_reason if output.finished else None
        choice: dict[str, Any] = {"index": 0}
        if job.chat and opening:
            choice["delta"] = {"role": "assistant", "content": text}
        elif job.chat and chunk:
            choice["delta"] = {"content": text} if text else {}
        elif job.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice.update(logprobs=logprobs, finish_reason=finish,
                      stop_reason=completion.stop_reason if output.finished else None)
        return choice

    async def stream(self, job: _Job) -> AsyncIterator[str]:
        """SSE chunks: text deltas of the cumulative outputs, then usage (if asked), [DONE].

        A chunk goes out when an output adds text, finishes the request, or adds tokens whose
        logprobs were asked for. A chat stream's first chunk names the role, carries the text
        of the engine's first output (its first token; possibly none) and waits for it, as
        vLLM's server waits with its role chunk: a client that times the first chunk
        (`vllm bench serve`) then measures time to first token, not time to acceptance.
        """
        usage_field = {"usage": None} if job.include_usage else {}
        num_chars = num_tokens = text_offset = 0
        try:
            final = None
            async for output in job.outputs:
                completion = output.outputs[0]
                delta = completion.text[num_chars:]
                logprobs = self._logprobs(job, output, num_tokens, text_offset)
                new_tokens = len(completion.token_ids) > num_tokens
                opening = job.chat and final is None
                if opening or delta or output.finished or (logprobs is not None and new_tokens):
                    choice = self._choice(job, output, delta, logprobs, chunk=True, opening=opening)
                    yield _sse({**self._envelope(job, [choice], chunk=True), **usage_field})
                if logprobs is not None and not job.chat:
                    text_offset += sum(len(s) for s in logprobs["tokens"])
                num_chars, num_tokens = len(completion.text), len(completion.token_ids)
                final = output
            if job.include_usage and final is not None:
                yield _sse({**self._envelope(job, [], chunk=True), "usage": _usage(final)})
        except Exception as e:  # headers are sent: the error can only travel as an event
            yield _sse(ErrorResponse(error=_engine_error(e).info).model_dump())
        finally:
            job.watcher.cancel()
            await job.outputs.aclose()
        yield "data: [DONE]\n\n"

    async def complete(self, job: _Job) -> dict[str, Any]:
        final = None
        try:
            async for output in job.outputs:
                final = output
        except (RequestFailedError, EngineDeadError) as e:
            raise _engine_error(e) from e
        finally:
            job.watcher.cancel()
            await job.outputs.aclose()
        assert final is not None and final.finished
        text = final.outputs[0].text
        choice = self._choice(job, final, text, self._logprobs(job, final, 0, 0), chunk=False)
        return {**self._envelope(job, [choice], chunk=False), "usage": _usage(final)}


def build_app(engine: AsyncLLMEngine, *, api_key: Optional[str] = None,
              max_waiting_requests: Optional[int] = None) -> FastAPI:
    """The FastAPI app around a running engine. The app does not own the engine: whoever made
    it shuts it down."""
    if max_waiting_requests is not None and max_waiting_requests < 1:
        raise ValueError(f"max_waiting_requests must be >= 1, got {max_waiting_requests}")
    server = OpenAIServer(engine, max_waiting_requests)
    app = FastAPI(title="tokenweir", version=tokenweir.__version__)
    app.state.server = server

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return _http_error(request, exc).response()

    @app.exception_handler(Exception)
    async def unexpected_error(_: Request, exc: Exception) -> JSONResponse:
        # Starlette still raises the exception after this answer, so uvicorn logs its traceback.
        return _engine_error(exc).response()

    v1 = APIRouter(prefix="/v1")

    @v1.post("/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await server.completions(body, raw)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await server.chat_completions(body, raw)

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        card = {"id": engine.model_name, "object": "model", "created": server.created,
                "owned_by": "tokenweir", "root": engine.core.loaded.path,
                "max_model_len": engine.max_model_len}
        return {"object": "list", "data": [card]}

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.is_running else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": tokenweir.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        # A plain route: mounting prometheus' ASGI app at /metrics answers with a redirect.
        return Response(generate_latest(engine.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    if api_key:
        app.add_middleware(_APIKeyMiddleware, api_key=api_key)
    return app


def run_server(engine_args: EngineArgs, ns: argparse.Namespace) -> None:
    """`tokenweir serve`: load the model, then serve until interrupted."""
    engine = AsyncLLMEngine.from_engine_args(engine_args)
    try:
        app = build_app(engine, api_key=ns.api_key, max_waiting_requests=ns.max_waiting_requests)
        uvicorn.run(app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level,
                    access_log=not ns.disable_uvicorn_access_log)
    finally:
        engine.shutdown()

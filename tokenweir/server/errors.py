"""Every failure as OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}.

A client's mistake is a 4xx naming the field where there is one; an engine failure a 500 (503
with Retry-After when the engine is gone); overload a 429 with Retry-After; a request shed at its
deadline, or before it because it cannot be met, a 504 that tells clients not to retry it. The handlers also
turn pydantic's and Starlette's own errors (which would be 422 and plain text) into this shape.
"""

from __future__ import annotations

from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from tokenweir.engine.client import DeadlineExceededError, EngineDeadError
from tokenweir.server.protocol import ErrorInfo, ErrorResponse

RETRY_AFTER_S = 1
# Union members and wrappers pydantic names in an error's location: not fields of the body.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


class APIError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None,
                 type: str = "invalid_request_error", code: Optional[str] = None,
                 headers: Optional[dict[str, str]] = None) -> None:
        # A client's text quoted in the message may hold lone surrogates (JSON's "\\ud800"):
        # escaped, or encoding the answer as UTF-8 would fail and turn a 4xx into a 500.
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(ErrorResponse(error=self.info).model_dump(), status_code=self.status,
                            headers=self.headers)


def bad_request(message: str, param: Optional[str]) -> APIError:
    return APIError(400, message, param=param)


def overloaded(message: str) -> APIError:
    return APIError(429, message, type="rate_limit_error", code="rate_limit_exceeded",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def engine_error(error: BaseException) -> APIError:
    if isinstance(error, DeadlineExceededError):
        # The request's own deadline, not a server fault: 504 with the reason, no Retry-After
        # (the same request would be late again). The official openai clients retry every 5xx
        # (twice by default) unless told `x-should-retry: false`: without it each shed request
        # would come back twice more, to queue (and perhaps prefill) again: under the overload
        # that shedding is for, it would triple the shed load.
        # 504 stays: the server gave up in time, as a gateway does; 408 means the client was
        # slow to send, and the clients retry it too.
        return APIError(504, str(error), type="timeout_error", code="deadline_exceeded",
                        headers={"x-should-retry": "false"})
    if isinstance(error, EngineDeadError):
        return APIError(503, str(error), type="server_error", code="engine_dead",
                        headers={"Retry-After": str(RETRY_AFTER_S)})
    return APIError(500, str(error), type="server_error", code="internal_error")


def engine_stalled(stalled_s: float, timeout_s: float) -> APIError:
    """/health of an engine that has made no progress for longer than the timeout: it may be
    hung (or in a step that long); it is not dead, and answers again once it steps."""
    return APIError(503, f"the engine has made no progress for {stalled_s:.1f} s while it has requests "
                         f"(--engine-hang-timeout {timeout_s:g} s)", type="server_error", code="engine_stalled",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def validation_error(exc: RequestValidationError) -> APIError:
    """The first pydantic error, as a 400 naming the field by its path (`messages.0.role`)."""
    err = exc.errors()[0]
    loc = [str(part) for part in err.get("loc", ())]
    if err.get("type") == "json_invalid":
        detail = err.get("ctx", {}).get("error", "")
        where = f" at position {loc[1]}" if len(loc) > 1 else ""
        return bad_request(f"the request body is not valid JSON: {detail}{where}", None)
    fields = loc[1:] if loc[:1] == ["body"] else loc
    path = ".".join(f for f in fields if f.isdigit() or f.isidentifier() and f not in _TYPE_TAGS)
    path = (err.get("ctx") or {}).get("param", path)  # a validator that names a deeper field
    if not path:
        return bad_request("the request body must be a JSON object (Content-Type: application/json): "
                           f"{err.get('msg')}", None)
    return bad_request(f"invalid '{path}': {err.get('msg')} (got {err.get('input')!r:.200})", path)


def http_error(request: Request, exc: HTTPException) -> APIError:
    """Starlette's own errors (unknown route, wrong method, and FastAPI's body that cannot be
    parsed, such as invalid UTF-8 or JSON nested too deeply), in OpenAI's shape."""
    message = f"{exc.detail} ({request.method} {request.url.path})"
    if exc.__cause__ is not None:  # FastAPI keeps why the body could not be parsed only here
        message = f"{message}: {exc.__cause__}"
    type = "server_error" if exc.status_code >= 500 else "invalid_request_error"
    return APIError(exc.status_code, message, type=type, headers=exc.headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return http_error(request, exc).response()

    @app.exception_handler(Exception)
    async def unexpected_error(_: Request, exc: Exception) -> JSONResponse:
        # Starlette still raises the exception after this answer, so uvicorn logs its traceback.
        return engine_error(exc).response()

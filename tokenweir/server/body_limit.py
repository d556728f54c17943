"""`--max-request-body-bytes`: a body larger than the limit is answered 413 while it arrives,
before any of it is parsed, so a client cannot make the server hold or parse megabytes of JSON.
"""

from __future__ import annotations

import asyncio
from typing import Optional

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenweir.server.errors import APIError

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024  # a prompt of ~1M tokens' worth of text
# A body not complete by then is answered 408: a client sending one byte now and then would
# hold its buffer (up to the limit) for as long as it liked.
BODY_TIMEOUT_S = 60.0


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than this server accepts ({limit} bytes).",
                    code="request_too_large")


class BodySizeLimitMiddleware:
    """Reads the whole body of a request to one of `paths` (at most `limit` bytes, within
    `timeout_s`) before the app runs, then replays it. Other requests pass unread: no other
    route reads a body, so none is buffered for them (uvicorn stops reading a body nobody reads).

    A declared Content-Length above the limit is refused before reading anything; a chunked body
    as soon as it passes the limit. After the body, `receive` is the server's own again, so the
    app still sees the client's disconnect.
    """

    def __init__(self, app: ASGIApp, limit: int, paths: tuple[str, ...], timeout_s: Optional[float] = None) -> None:
        self.app = app
        self.limit = limit
        self.paths = frozenset(paths)
        self.timeout_s = BODY_TIMEOUT_S if timeout_s is None else timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await _too_large(self.limit).response()(scope, receive, send)
            return
        body = bytearray()
        try:
            async with asyncio.timeout(self.timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return  # the client left before its body was complete: nothing to answer
                    body += message.get("body", b"")
                    if len(body) > self.limit:
                        await _too_large(self.limit).response()(scope, receive, send)
                        return
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            error = APIError(408, f"The request body did not arrive within {self.timeout_s:g} s.",
                             code="request_timeout")
            await error.response()(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

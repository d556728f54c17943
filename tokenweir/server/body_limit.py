"""`--max-request-body-bytes`: a body larger than the limit is answered 413 while it arrives,
before any of it is parsed, so a client cannot make the server hold or parse megabytes of JSON.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenweir.server.errors import APIError

DEFAULT_MAX_REQUEST_BODY_BYTES = 4 * 1024 * 1024  # a prompt of ~1M tokens' worth of text


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than this server accepts ({limit} bytes).",
                    code="request_too_large")


class BodySizeLimitMiddleware:
    """Reads the whole body (at most `limit` bytes) before the app runs, then replays it.

    A declared Content-Length above the limit is refused before reading anything; a chunked body
    as soon as it passes the limit. After the body, `receive` is the server's own again, so the
    app still sees the client's disconnect.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await _too_large(self.limit).response()(scope, receive, send)
            return
        body = bytearray()
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
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

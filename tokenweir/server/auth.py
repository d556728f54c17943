"""`--api-key`: requires `Authorization: Bearer KEY` on the guarded paths, before the body is read."""

from __future__ import annotations

import secrets

from starlette.types import ASGIApp, Receive, Scope, Send

from tokenweir.server.errors import APIError

# Always guarded: everything that runs the model or describes it.
API_PREFIX = "/v1/"
# Guarded unless the operator opens it: the prefix-cache counters tell a client whether another
# user's prefix is cached (vLLM leaves /metrics open; Prometheus can send the key as a bearer
# token, so closing it costs a scrape-config line).
METRICS_PATH = "/metrics"


def guarded_paths(metrics_require_api_key: bool) -> tuple[str, ...]:
    return (API_PREFIX, METRICS_PATH) if metrics_require_api_key else (API_PREFIX,)


class APIKeyMiddleware:
    """A plain ASGI middleware (not BaseHTTPMiddleware), so that streaming and disconnect
    detection pass through untouched. /health and /version stay open for probes."""

    def __init__(self, app: ASGIApp, api_key: str, guarded: tuple[str, ...]) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.guarded = guarded

    def _is_guarded(self, path: str) -> bool:
        return any(path == p or path.startswith(p.rstrip("/") + "/") for p in self.guarded)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._is_guarded(scope["path"]):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                error = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                                 code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

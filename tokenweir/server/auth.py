"""`--api-key` / `--api-keys-file`: require `Authorization: Bearer KEY` on the guarded paths,
before the body is read. With a keys file each key names its tenant, and that tenant is the
request's: it overrides a `tenant` in the body, so no client can claim another's fair share.
A key may also bound its requests' priority (`{"tenant": ..., "priority": P}`: none is more
important than P): under `sla` the priority class ranks before the tenant, so a tenant free to
name class 0 could outrank the others' shares.
The two flags are exclusive: a plain key next to a keys file would name no tenant, and its
holders would be back to naming any tenant in the body (a shared key goes in the file, under a
tenant of its own)."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from starlette.requests import Request

from starlette.types import ASGIApp, Receive, Scope, Send

from tokenweir.checks import is_integer
from tokenweir.metrics import NO_TENANT, OTHER_TENANTS
from tokenweir.request import MAX_KEY_CHARS, PRIORITY_MAX, PRIORITY_MIN
from tokenweir.server.errors import APIError

# Always guarded: everything that runs the model or describes it.
API_PREFIX = "/v1/"
# Guarded unless the operator opens it: the prefix-cache counters tell a client whether another
# user's prefix is cached (vLLM leaves /metrics open; Prometheus can send the key as a bearer
# token, so closing it costs a scrape-config line).
METRICS_PATH = "/metrics"


# A keys-file tenant has a metric label of its own, so it may not take these.
_RESERVED_LABELS = {NO_TENANT: "requests without a tenant", OTHER_TENANTS: "the tenants past the label bound"}

# Where the middleware leaves the authenticated key's grant in the ASGI scope.
GRANT_SCOPE_KEY = "tokenweir.key_grant"


@dataclass(frozen=True)
class KeyGrant:
    """What a key of the keys file grants its requests: their tenant, and with `priority` the
    most important priority they may have (vLLM's sense, smaller first: a request asking for a
    smaller one gets this one; a larger one, less important, is kept)."""

    tenant: str
    priority: Optional[int] = None

    def priority_of(self, requested: int) -> int:
        return requested if self.priority is None else max(requested, self.priority)


# FastAPI's schema and its two viewers describe the model's limits: guarded like /v1/models.
DOCS_PATHS = ("/openapi.json", "/docs", "/redoc")

# RFC 6750's bearer token: what an Authorization header can carry unchanged. A key with a space,
# a line break or a non-ASCII character could never be sent as it is, so never match.
_BEARER_TOKEN = re.compile(r"[A-Za-z0-9\-._~+/]+=*")


def guarded_paths(metrics_require_api_key: bool) -> tuple[str, ...]:
    return (API_PREFIX, *DOCS_PATHS, *((METRICS_PATH,) if metrics_require_api_key else ()))


def check_api_key(key: Any, what: str) -> None:
    """A key a client can send: refused at startup rather than never matching (or, empty,
    turning authentication off: `--api-key "$UNSET"`)."""
    if not isinstance(key, str) or not _BEARER_TOKEN.fullmatch(key):
        raise ValueError(f"{what} must be a non-empty bearer token (letters, digits and -._~+/, "
                         "optionally ending in '='), as an Authorization header carries it")


def check_api_key_options(api_key: Optional[str], api_keys: Optional[dict[str, KeyGrant]]) -> None:
    """build_app's side of the exclusion (`serve`'s argparse group refuses the two flags)."""
    if api_key is not None:
        check_api_key(api_key, "api_key (--api-key)")
    if api_keys and not all(isinstance(grant, KeyGrant) for grant in api_keys.values()):
        raise ValueError("api_keys maps each key to a KeyGrant (load_api_keys reads them from a keys file)")
    if api_key and api_keys:
        raise ValueError("api_key (--api-key) and api_keys (--api-keys-file) are exclusive: with a keys "
                         "file every key names its tenant; put the shared key in the file under a "
                         "tenant of its own")


class _DuplicateKeyError(ValueError):
    pass


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json's object hook: json keeps the last of a key given twice, which would bill the key's
    requests to the wrong tenant without a word."""
    first: dict[str, int] = {}
    for position, (key, _) in enumerate(pairs, 1):
        if key in first:
            raise _DuplicateKeyError(f"key #{position} is key #{first[key]} again")
        first[key] = position
    return dict(pairs)


def load_api_keys(path: Path) -> dict[str, KeyGrant]:
    """A JSON object {key: tenant} or {key: {"tenant": tenant, "priority": P}}, each tenant a
    name a request could carry (non-empty, at most MAX_KEY_CHARS characters) and not one of the
    metric labels reserved for no tenant and for the overflow, P an integer priority. Checked
    here, at startup: a request must never fail for its key's grant. Errors name a key by its
    position only (the keys are secrets)."""
    where = f"--api-keys-file {str(path)!r}"
    try:
        data = json.loads(Path(path).read_text(), object_pairs_hook=_refuse_duplicate_keys)
    except _DuplicateKeyError as e:
        raise ValueError(f"{where}: {e}; a key names one tenant") from None
    except (OSError, ValueError) as e:
        raise ValueError(f"{where} cannot be read as JSON: {e}") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{where} must hold a non-empty JSON object {{key: tenant}}")
    grants = {}
    for position, (key, value) in enumerate(data.items(), 1):
        check_api_key(key, f"{where}: key #{position}")
        priority = None
        if isinstance(value, dict):
            unknown = set(value) - {"tenant", "priority"}
            if unknown:
                raise ValueError(f"{where}: key #{position} has unknown fields {sorted(unknown)}; a key "
                                 "names a tenant, or {\"tenant\": name, \"priority\": P}")
            tenant, priority = value.get("tenant"), value.get("priority")
            if priority is not None and (not is_integer(priority) or not PRIORITY_MIN <= priority <= PRIORITY_MAX):
                raise ValueError(f"{where}: the priority of key #{position} must be an integer in "
                                 f"[{PRIORITY_MIN}, {PRIORITY_MAX}], got {priority!r:.40}")
        else:
            tenant = value
        if not isinstance(tenant, str) or not tenant:
            raise ValueError(f"{where}: every key needs a non-empty tenant name, got {tenant!r:.80} "
                             f"for key #{position}")
        try:  # a lone surrogate (valid JSON) would make every later /metrics answer a 500
            tenant.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{where}: the tenant of key #{position} is not valid Unicode text "
                             f"(a lone surrogate): {tenant!r:.40}") from None
        if len(tenant) > MAX_KEY_CHARS:
            raise ValueError(f"{where}: the tenant of key #{position} has {len(tenant)} characters, "
                             f"more than {MAX_KEY_CHARS}: {tenant!r:.40}")
        if tenant in _RESERVED_LABELS:
            raise ValueError(f"{where}: the tenant of key #{position} is {tenant!r}, the tenant metric "
                             f"label of {_RESERVED_LABELS[tenant]}; name it otherwise")
        grants[key] = KeyGrant(tenant, priority)
    return grants


def authenticated_grant(request: Request) -> Optional[KeyGrant]:
    """The grant of the key the request authenticated with (None without a keys file)."""
    return request.scope.get(GRANT_SCOPE_KEY)


class APIKeyMiddleware:
    """A plain ASGI middleware (not BaseHTTPMiddleware), so that streaming and disconnect
    detection pass through untouched. /health and /version stay open for probes."""

    def __init__(self, app: ASGIApp, api_keys: dict[str, Optional[KeyGrant]], guarded: tuple[str, ...]) -> None:
        """`api_keys`: key -> its grant (None: a key that grants nothing, `--api-key`)."""
        self.app = app
        self.expected = [(key.encode(), grant) for key, grant in api_keys.items()]
        self.guarded = guarded

    def _is_guarded(self, path: str) -> bool:
        return any(path == p or path.startswith(p.rstrip("/") + "/") for p in self.guarded)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._is_guarded(scope["path"]):
            scheme, _, given = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            bearer = scheme.lower() == b"bearer"  # RFC 7235: the scheme is case-insensitive
            matched, grant = False, None
            for expected, key_grant in self.expected:  # every key compared: no early exit to time
                if secrets.compare_digest(given, expected) and bearer:
                    matched, grant = True, key_grant
            if not matched:
                error = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                                 code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
            if grant is not None:
                scope[GRANT_SCOPE_KEY] = grant
        await self.app(scope, receive, send)

"""Flags of `tokenweir serve` beyond the engine's own (those come from EngineArgs)."""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenweir.server.auth import check_api_key
from tokenweir.server.body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES

# As long as a cluster waits for a replica stuck in a step (ClusterConfig.replica_hang_timeout).
DEFAULT_ENGINE_HANG_TIMEOUT_S = 30.0


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _seconds_or_off(text: str) -> float:
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0 (0: off), got {text}")
    return value


def _api_key(text: str) -> str:
    try:
        check_api_key(text, "the key")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_server_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    # Exclusive: a plain key beside a keys file would name no tenant, and its holders could
    # claim any tenant's share by the body's `tenant`.
    keys = parser.add_mutually_exclusive_group()
    keys.add_argument("--api-key", default=None, type=_api_key,
                      help="require 'Authorization: Bearer KEY' on /v1/* (and /metrics, see below); the "
                           "body's `tenant` names the request's tenant (not with --api-keys-file)")
    keys.add_argument("--api-keys-file", type=Path, default=None,
                      help="JSON {key: tenant} (or {key: {\"tenant\": name, \"priority\": P}}: no request "
                           "of the key more important than P): each key is accepted and fixes the request's tenant "
                           "(overriding the body's `tenant`) for per-tenant fair share and metrics, "
                           "with a metric label of its own (without a keys file the body names the "
                           "tenant, and only the first 32 named get one: later ones share 'other'). "
                           "Not with --api-key: put a shared key in the file under a tenant of its own")
    parser.add_argument("--metrics-require-api-key", action=argparse.BooleanOptionalAction, default=True,
                        help="with --api-key or --api-keys-file, /metrics needs a key too (default on: its "
                             "prefix-cache counters tell whether another user's prefix is cached; vLLM "
                             "leaves it open)")
    parser.add_argument("--max-waiting-requests", type=_positive_int, default=None,
                        help="answer 429 with Retry-After once this many requests wait")
    parser.add_argument("--max-request-body-bytes", type=_positive_int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        help="answer 413 to a larger request body, before parsing it (default %(default)s)")
    parser.add_argument("--engine-hang-timeout", type=_seconds_or_off, default=DEFAULT_ENGINE_HANG_TIMEOUT_S,
                        help="/health answers 503 once the engine has made no progress for this many seconds "
                             "while it has requests: hung, or in one step that long (default %(default)s; 0: "
                             "off; with --data-parallel-size > 1 the cluster fails hung replicas over instead, "
                             "see --replica-hang-timeout)")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=("critical", "error", "warning", "info", "debug", "trace"))
    parser.add_argument("--step-trace", default=None, metavar="FILE",
                        help="write each engine step's composition and duration as a JSON line "
                             "(what `tokenweir profile --serving` fits the simulator's cost model to)")
    parser.add_argument("--engine-in-process", action="store_true",
                        help="run the engine loop in a thread of the server's process instead of a "
                             "process of its own (which keeps the model's threads off the server's "
                             "interpreter lock)")
    parser.add_argument("--disable-uvicorn-access-log", action="store_true",
                        help="do not log one line per HTTP request")

"""Soak: thousands of requests from concurrent clients against `tokenweir serve`'s app on 127.0.0.1,
with disconnects, aborts and bad inputs mixed in; then check that nothing leaked.

The server runs in this process (a real uvicorn socket on loopback, the real default model) so
that, once the clients are done, the engine's own tables can be inspected: running / waiting / KV
blocks back to zero, the runner's per-request state and seeded generators empty, the async
engine's stream tables empty. Request accounting must close: every request sent ends as stopped,
length, aborted (the client left) or rejected (a 4xx, 429 included). Writes
docs/benchmarks/soak.md (+ .json).

    .venv/bin/python benchmarks/soak.py [--num-requests 3000] [--clients 32] [--time-limit-s 600]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import platform
import random
import resource
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from tokenweir.config import EngineArgs
from tokenweir.engine.async_engine import AsyncLLMEngine
from tokenweir.server.app import build_app

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
WORDS = "the quick brown fox jumps over a lazy dog while seven tired owls watch quietly".split()

# (kind, weight). Bad inputs each expect a 4xx naming what is wrong.
KINDS = [("completion", 30), ("completion_stream", 25), ("chat", 15), ("chat_stream", 10),
         ("disconnect", 8), ("abort_timeout", 4), ("bad_temperature", 2), ("bad_role", 2),
         ("bad_stop_list", 2), ("empty_prompt", 1), ("too_long", 1)]


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60)))


def body_for(kind: str, rng: random.Random, model: str) -> tuple[str, dict[str, Any]]:
    base = {"model": model, "max_tokens": rng.randint(1, 24), "temperature": rng.choice([0.0, 0.8]),
            "seed": rng.randint(0, 1000)}
    if kind.startswith("chat") or kind == "bad_role":
        role = "wizard" if kind == "bad_role" else "user"
        return "/v1/chat/completions", {**base, "messages": [{"role": role, "content": prompt(rng)}],
                                        "stream": kind == "chat_stream"}
    body = {**base, "prompt": prompt(rng), "stream": kind in ("completion_stream", "disconnect", "abort_timeout")}
    if kind == "bad_temperature":
        body["temperature"] = -1
    elif kind == "bad_stop_list":
        body["stop"] = [f"s{i}" for i in range(10_000)]
    elif kind == "empty_prompt":
        body["prompt"] = ""
    elif kind == "too_long":
        body["prompt"] = "word " * 20_000
    if kind in ("disconnect", "abort_timeout"):
        body["max_tokens"] = 64
    return "/v1/completions", body


async def one_request(client: httpx.AsyncClient, kind: str, rng: random.Random, model: str,
                      tally: collections.Counter) -> None:
    path, body = body_for(kind, rng, model)
    try:
        if not body.get("stream"):
            r = await client.post(path, json=body)
            if r.status_code >= 500:
                tally["server_error"] += 1
            elif r.status_code >= 400:
                tally["rejected"] += 1
                tally[f"rejected_{r.status_code}"] += 1
            else:
                tally[r.json()["choices"][0]["finish_reason"]] += 1
            return
        timeout = httpx.Timeout(0.05, connect=5.0) if kind == "abort_timeout" else None
        async with client.stream("POST", path, json=body, timeout=timeout) as r:
            if r.status_code >= 400:
                await r.aread()
                tally["server_error" if r.status_code >= 500 else "rejected"] += 1
                if r.status_code < 500:
                    tally[f"rejected_{r.status_code}"] += 1
                return
            chunks, finish = 0, None
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    tally["server_error"] += 1
                    return
                chunks += 1
                for choice in event.get("choices", []):
                    finish = choice.get("finish_reason") or finish
                if kind == "disconnect" and chunks >= 3:
                    tally["aborted"] += 1  # leave mid-stream: the server must abort and free it
                    return
            tally[finish or "no_finish"] += 1
    except httpx.TimeoutException:
        tally["aborted"] += 1  # the client gave up; the server sees a disconnect
    except httpx.HTTPError as e:
        tally[f"client_error_{type(e).__name__}"] += 1


async def run_clients(base_url: str, model: str, num_requests: int, num_clients: int, seed: int,
                      time_limit_s: float) -> tuple[collections.Counter, int, float]:
    kinds, weights = zip(*KINDS)
    tally: collections.Counter = collections.Counter()
    sent = 0
    lock = asyncio.Lock()
    start = time.monotonic()

    async def client_loop(index: int) -> None:
        nonlocal sent
        rng = random.Random(seed * 1000 + index)
        async with httpx.AsyncClient(base_url=base_url, timeout=120.0) as client:
            while time.monotonic() - start < time_limit_s:
                async with lock:
                    if sent >= num_requests:
                        return
                    sent += 1
                await one_request(client, rng.choices(kinds, weights)[0], rng, model, tally)

    await asyncio.gather(*(client_loop(i) for i in range(num_clients)))
    return tally, sent, time.monotonic() - start


def engine_tables(engine: AsyncLLMEngine) -> dict[str, int]:
    """Sizes of every table that must be empty once the engine is idle."""
    core = engine.core
    kv = core.scheduler.kv_cache_manager
    return {"running": len(core.scheduler.running), "waiting": len(core.scheduler.waiting),
            "scheduler_requests": len(core.scheduler.requests),
            "kv_blocks_used": kv.block_pool.num_blocks - kv.get_num_free_blocks(),
            "kv_request_tables": len(kv.req_to_blocks) + len(kv.num_cached_blocks),
            "runner_requests": len(core.runner.requests), "runner_generators": len(core.runner.generators),
            "output_states": len(core.states), "streams": len(engine._active) + len(engine._side.streams)}


def serve_in_thread(engine: AsyncLLMEngine, max_waiting: int) -> tuple[uvicorn.Server, threading.Thread, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    app = build_app(engine, max_waiting_requests=max_waiting)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    return server, thread, port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-requests", type=int, default=3000)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--time-limit-s", type=float, default=600.0)
    parser.add_argument("--max-waiting-requests", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=2,
                        help="soak rounds in one process: RSS that grows after the first is a leak, "
                             "growth in the first alone is the allocator keeping memory for reuse")
    args = parser.parse_args()

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(disable_log_stats=True))
    rss_loaded = rss_mib()
    server, thread, port = serve_in_thread(engine, args.max_waiting_requests)
    model = engine.model_info.name
    tally: collections.Counter = collections.Counter()
    sent, elapsed, rss_rounds = 0, 0.0, []
    for round_index in range(args.rounds):
        round_tally, round_sent, round_elapsed = asyncio.run(run_clients(
            f"http://127.0.0.1:{port}", model, args.num_requests, args.clients, args.seed + round_index,
            args.time_limit_s))
        tally.update(round_tally)
        sent += round_sent
        elapsed += round_elapsed
        deadline = time.monotonic() + 30
        while engine.num_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the engine thread settles its last command batch
        rss_rounds.append(round(rss_mib(), 1))
    tables = engine_tables(engine)
    server.should_exit = True
    thread.join(timeout=10)
    engine.shutdown()

    finished = {k: tally[k] for k in ("stop", "length", "aborted", "rejected")}
    accounted = sum(finished.values())
    result = {
        "machine": f"{platform.machine()}, CPython {platform.python_version()}, 2 shared cores",
        "command": f".venv/bin/python benchmarks/soak.py --num-requests {args.num_requests} --clients {args.clients} "
                   f"--max-waiting-requests {args.max_waiting_requests} --seed {args.seed} --rounds {args.rounds}",
        "sent": sent, "elapsed_s": round(elapsed, 1), "outcomes": dict(sorted(tally.items())),
        "accounted": accounted, "accounting_closes": accounted == sent,
        "server_errors": tally["server_error"], "engine_tables_after": tables,
        "leak_free": all(v == 0 for v in tables.values()),
        "rss_mib": {"after_load": round(rss_loaded, 1), "after_each_round": rss_rounds,
                    "peak": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)},
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "soak.json").write_text(json.dumps(result, indent=2))
    lines = ["# Soak", "", "Thousands of requests from concurrent clients against the server's app on 127.0.0.1 "
             "(the default model, in this process so the engine's tables can be checked afterwards), "
             "with mid-stream disconnects, client timeouts and bad inputs mixed in (`KINDS` in the script).", "",
             f"Command: `{result['command']}`  ", f"Machine: {result['machine']}.", "",
             f"- Sent {sent} requests ({args.rounds} rounds of {args.num_requests}) in {result['elapsed_s']} s; outcomes: "
             + ", ".join(f"{k} {v}" for k, v in result["outcomes"].items()) + ".",
             f"- Accounting: sent {sent} = stop {finished['stop']} + length {finished['length']} + aborted "
             f"{finished['aborted']} + rejected {finished['rejected']} = {accounted}: "
             f"{'closes' if result['accounting_closes'] else 'DOES NOT close'}.",
             f"- Server errors (5xx or SSE error events): {result['server_errors']}.",
             "- Engine tables after the soak: " + ", ".join(f"{k} {v}" for k, v in tables.items())
             + (" (all empty)." if result["leak_free"] else " (LEAK)."),
             f"- RSS: {result['rss_mib']['after_load']} MiB after loading, then after each round "
             + ", ".join(f"{v} MiB" for v in rss_rounds) + f"; peak {result['rss_mib']['peak']} MiB "
             "(the clients run in this process too). The first round's growth includes the allocator "
             "keeping freed memory for reuse (engine/cpu_allocator.py); what later rounds add is "
             "memory not returned, whatever holds it.", ""]
    (OUT / "soak.md").write_text("\n".join(lines))
    print("\n".join(lines))
    if not (result["accounting_closes"] and result["leak_free"] and not result["server_errors"]):
        raise SystemExit("soak failed: see docs/benchmarks/soak.md")


if __name__ == "__main__":
    main()

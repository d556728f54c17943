"""`bench serve` end to end against a tiny streaming OpenAI-style server run in this process."""

import argparse
import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenweir.bench.serve import add_cli_args, main

FIRST_TOKEN_DELAY_S = 0.05
TOKEN_GAP_S = 0.01
FAILING_REQUEST = 3  # the server answers its third request with HTTP 500


def make_app(received: list[dict]) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "tiny-model", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        received.append(body)
        if len(received) == FAILING_REQUEST:
            return JSONResponse({"error": "injected failure"}, status_code=500)
        num_out = body["max_tokens"]
        usage = {"prompt_tokens": len(body["prompt"].split()), "completion_tokens": num_out}

        async def stream():
            await asyncio.sleep(FIRST_TOKEN_DELAY_S)
            for i in range(num_out):
                if i:
                    await asyncio.sleep(TOKEN_GAP_S)
                chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@pytest.fixture
def server() -> Iterator[tuple[str, list[dict]]]:
    received: list[dict] = []
    # Bind first and hand uvicorn the socket, so the free port cannot be taken in between.
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(make_app(received), log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline, "test server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", received
    srv.should_exit = True
    thread.join(timeout=10)
    sock.close()


def test_bench_serve_end_to_end(server, tmp_path):
    base_url, received = server
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args([
        "--base-url", base_url, "--num-prompts", "8", "--request-rate", "100",
        "--max-concurrency", "4", "--random-input-len", "16", "--random-output-len", "5",
        "--random-range-ratio", "0.5", "--seed", "1", "--goodput", "ttft:60000",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "out.json",
    ])
    result = main(args)

    assert len(received) == 8
    assert all(b["model"] == "tiny-model" and b["ignore_eos"] is True and b["stream"]
               for b in received)
    assert (result["completed"], result["failed"]) == (7, 1)
    assert sum("HTTP 500" in e for e in result["errors"]) == 1

    ok = [i for i, e in enumerate(result["errors"]) if not e]
    out_lens = [result["output_lens"][i] for i in ok]
    in_lens = [result["input_lens"][i] for i in ok]
    assert all(2 <= n <= 8 for n in out_lens) and all(8 <= n <= 24 for n in in_lens)
    assert result["total_output_tokens"] == sum(out_lens)
    assert result["total_input_tokens"] == sum(in_lens)  # the server counted prompt words
    # One chunk per token, so the pooled ITL has output_len - 1 gaps per request.
    assert sum(len(result["itls"][i]) for i in ok) == sum(n - 1 for n in out_lens)

    # Loosely consistent with the server's sleeps; no tight wall-time bounds.
    assert 0.8 * FIRST_TOKEN_DELAY_S * 1000 <= result["median_ttft_ms"] < 5000
    assert 0.8 * TOKEN_GAP_S * 1000 <= result["median_itl_ms"] < 1000
    assert 0.8 * TOKEN_GAP_S * 1000 <= result["median_tpot_ms"] < 1000
    assert result["median_e2el_ms"] > result["median_ttft_ms"]
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    assert result["request_throughput"] == pytest.approx(7 / result["duration"])

    saved = json.loads((tmp_path / "out.json").read_text())
    assert saved["completed"] == 7 and saved["model_id"] == "tiny-model"
    assert saved["request_rate"] == 100.0 and saved["max_concurrency"] == 4

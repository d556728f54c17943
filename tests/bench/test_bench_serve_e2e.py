"""`bench serve` end to end against a tiny streaming OpenAI-style server run in this process."""

import argparse
import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenweir.bench.serve import add_cli_args, main

FIRST_TOKEN_DELAY_S = 0.05
TOKEN_GAP_S = 0.01
FAILING_REQUEST = 3  # the server answers its third request with HTTP 500
# Added to the prompt's word count in usage, as a chat template would: the client must keep the
# dataset's own prompt length.
USAGE_PROMPT_EXTRA = 1000


@dataclass
class FakeServer:
    url: str = ""
    received: list[dict] = field(default_factory=list)
    in_flight: int = 0
    peak_in_flight: int = 0
    api_key: str = "secret"


def make_app(state: FakeServer) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models(request: Request):
        if request.headers.get("authorization") != f"Bearer {state.api_key}":
            return JSONResponse({"error": {"message": "bad key"}}, status_code=401)
        return {"object": "list", "data": [{"id": "tiny-model", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        state.received.append(body)
        if len(state.received) == FAILING_REQUEST:
            return JSONResponse({"error": "injected failure"}, status_code=500)
        num_out = body["max_tokens"]
        usage = {"prompt_tokens": len(body["prompt"].split()) + USAGE_PROMPT_EXTRA,
                 "completion_tokens": num_out}
        # Counted from here until the stream's last data event; the client can send its next
        # request only after reading [DONE], so the count is down by then.
        state.in_flight += 1
        state.peak_in_flight = max(state.peak_in_flight, state.in_flight)

        async def stream():
            await asyncio.sleep(FIRST_TOKEN_DELAY_S)
            for i in range(num_out):
                if i:
                    await asyncio.sleep(TOKEN_GAP_S)
                chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            state.in_flight -= 1
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    return app


@pytest.fixture
def server() -> Iterator[FakeServer]:
    state = FakeServer()
    # Bind first and hand uvicorn the socket, so the free port cannot be taken in between.
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    state.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    srv = uvicorn.Server(uvicorn.Config(make_app(state), log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started:
        assert time.monotonic() < deadline, "test server did not start"
        time.sleep(0.01)
    yield state
    srv.should_exit = True
    thread.join(timeout=10)
    sock.close()


def run_bench(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    return main(parser.parse_args(["--api-key", "secret", *argv]))


def test_bench_serve_end_to_end(server, tmp_path):
    result = run_bench(
        "--base-url", server.url, "--num-prompts", "8", "--request-rate", "100",
        "--max-concurrency", "4", "--random-input-len", "16", "--random-output-len", "5",
        "--random-range-ratio", "0.5", "--seed", "1", "--goodput", "ttft:60000",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "out.json", "--ignore-eos",
    )

    assert len(server.received) == 8
    assert all(b["model"] == "tiny-model" and b["ignore_eos"] is True and b["stream"]
               for b in server.received)
    assert (result["completed"], result["failed"]) == (7, 1)
    assert sum("HTTP 500" in e for e in result["errors"]) == 1

    ok = [i for i, e in enumerate(result["errors"]) if not e]
    out_lens = [result["output_lens"][i] for i in ok]
    in_lens = [result["input_lens"][i] for i in ok]
    assert all(2 <= n <= 8 for n in out_lens) and all(8 <= n <= 24 for n in in_lens)
    assert result["total_output_tokens"] == sum(out_lens)
    # The dataset's nominal lengths (one token a filler word), not the server's inflated usage.
    assert sorted(result["input_lens"]) == sorted(len(b["prompt"].split()) for b in server.received)
    assert result["total_input_tokens"] == sum(in_lens)
    assert [result["generated_texts"][i] for i in ok] == [
        "".join(f" t{j}" for j in range(n)) for n in out_lens]
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


@pytest.mark.parametrize("limit", [4, None])
def test_max_concurrency_caps_requests_in_flight(server, limit):
    # 16 requests at once, each held open >= 50 ms by the server: with a limit of 4 exactly 4
    # are in flight at the peak; without one, more are.
    argv = ["--base-url", server.url, "--num-prompts", "16", "--random-input-len", "4",
            "--random-output-len", "3"]
    if limit is not None:
        argv += ["--max-concurrency", str(limit)]
    result = run_bench(*argv)
    assert len(server.received) == 16 and result["completed"] == 15
    if limit is None:
        assert server.peak_in_flight > 4
    else:
        assert server.peak_in_flight == limit


def test_ignore_eos_is_off_by_default(server):
    # As in vLLM: the field is not OpenAI's, and servers such as `transformers serve` reject it.
    run_bench("--base-url", server.url, "--num-prompts", "2", "--random-input-len", "4",
              "--random-output-len", "2")
    assert len(server.received) == 2 and not any("ignore_eos" in b for b in server.received)


@pytest.mark.parametrize("argv, message", [
    (["--api-key", "wrong"], r"/v1/models answered HTTP 401: .*check --api-key"),
    (["--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),
    (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
])
def test_bad_arguments_are_one_line_errors(server, argv, message):
    with pytest.raises(ValueError, match=message):
        run_bench("--base-url", server.url, "--num-prompts", "2", *argv)
    assert server.received == []


def test_unreachable_server_is_a_one_line_error():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # a port nobody listens on
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(ValueError, match=f"cannot reach {url}/v1/models"):
        run_bench("--base-url", url, "--num-prompts", "1")
    sock.close()

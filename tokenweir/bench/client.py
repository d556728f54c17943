"""One streamed request to an OpenAI-compatible server, timed chunk by chunk."""

import json
import time

import aiohttp

from tokenweir.bench.datasets import BenchRequest
from tokenweir.bench.serve_metrics import RequestRecord

CHAT_ENDPOINT = "/v1/chat/completions"


def build_payload(endpoint: str, model: str, request: BenchRequest, ignore_eos: bool) -> dict:
    payload: dict = {
        "model": model,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint.endswith(CHAT_ENDPOINT):
        payload["messages"] = [{"role": "user", "content": request.prompt}]
        # OpenAI deprecated max_tokens for chat in favour of max_completion_tokens; send both
        # so servers that know only one of them still cap the output.
        payload["max_completion_tokens"] = request.output_len
    else:
        payload["prompt"] = request.prompt
    if ignore_eos:
        # Not an OpenAI field: vLLM-style servers accept it so outputs have the asked length.
        payload["ignore_eos"] = True
    return payload


def parse_chunk(data: dict) -> tuple[str, dict | None]:
    """(output text, usage or None) of one SSE event from either endpoint.

    Chat streams open with a role-only delta and may carry reasoning before content;
    reasoning counts as output (it is generated tokens), the empty role delta does not.
    """
    text = ""
    if choices := data.get("choices"):
        choice = choices[0]
        if "text" in choice:
            text = choice["text"] or ""
        else:
            delta = choice.get("delta") or {}
            text = (delta.get("content") or delta.get("reasoning_content")
                    or delta.get("reasoning") or "")
    return text, data.get("usage")


async def send_request(session: aiohttp.ClientSession, url: str, headers: dict[str, str],
                       payload: dict, request: BenchRequest) -> RequestRecord:
    """Run one request; HTTP errors and exceptions are recorded in the result, never raised."""
    record = RequestRecord(success=False, prompt_len=request.prompt_len)
    num_text_chunks = 0
    usage: dict | None = None
    start = time.perf_counter()
    last_chunk = start
    try:
        async with session.post(url, json=payload, headers=headers) as response:
            if response.status != 200:
                body = await response.text()
                record.error = f"HTTP {response.status}: {body[:500]}"
                return record
            # aiohttp yields the body line by line, so split SSE frames need no reassembly.
            async for raw in response.content:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                body = line.removeprefix("data:").strip()
                if body == "[DONE]":
                    break
                data = json.loads(body)
                if "error" in data:
                    record.error = f"stream error: {data['error']}"
                    return record
                now = time.perf_counter()
                text, chunk_usage = parse_chunk(data)
                usage = chunk_usage or usage
                if not text:
                    continue
                if num_text_chunks == 0:
                    record.ttft = now - start
                else:
                    record.itl.append(now - last_chunk)
                last_chunk = now
                num_text_chunks += 1
        record.latency = time.perf_counter() - start
    except Exception as e:  # a load generator reports failures; it must not stop on one
        record.error = f"{type(e).__name__}: {e}"
        return record
    if num_text_chunks == 0:
        # Without a first text chunk there is no TTFT to report.
        record.error = "stream carried no output text"
        return record
    record.success = True
    if usage and usage.get("completion_tokens") is not None:
        record.output_tokens = int(usage["completion_tokens"])
    else:
        record.output_tokens = num_text_chunks
    if usage and usage.get("prompt_tokens") is not None:
        record.prompt_len = int(usage["prompt_tokens"])
    return record

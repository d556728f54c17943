"""One streamed request to an OpenAI-compatible server, timed chunk by chunk as `vllm bench serve`
times it.

Every SSE event whose `choices` list is non-empty is a timed chunk, even when its text is empty
(a chat stream's role-only opening delta, a final chunk that carries only finish_reason): the
first sets TTFT, each later one adds an ITL gap, and the last one ends the request's latency.
Events without choices (the usage summary) are not timed. Output text accumulates over the
chunks; output tokens come from the server's `usage.completion_tokens`. The prompt length stays
the dataset's own, whatever the server reports in `usage.prompt_tokens`.
"""

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


def choice_text(choice: dict) -> str:
    """Output text of one streamed choice from either endpoint; reasoning counts as output
    (it is generated tokens)."""
    if "text" in choice:
        return choice["text"] or ""
    delta = choice.get("delta") or {}
    return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""


class StreamTimer:
    """Builds a request's record from its SSE events and their arrival times (seconds on the
    clock `start` was read from), so the timing rules can be checked on hand-made streams."""

    def __init__(self, request: BenchRequest, start: float) -> None:
        self.record = RequestRecord(success=False, prompt_len=request.prompt_len)
        self._start = start
        self._last_chunk: float | None = None
        self._text: list[str] = []
        self._num_text_chunks = 0
        self._completion_tokens: int | None = None

    def on_event(self, data: dict, now: float) -> None:
        """One SSE event's JSON data, received at `now`."""
        if usage := data.get("usage"):
            if usage.get("completion_tokens") is not None:
                self._completion_tokens = int(usage["completion_tokens"])
        choices = data.get("choices")
        if not choices:
            return
        if self._last_chunk is None:
            self.record.ttft = now - self._start
        else:
            self.record.itl.append(now - self._last_chunk)
        self._last_chunk = now
        text = choice_text(choices[0])
        self._text.append(text)
        self._num_text_chunks += bool(text)

    def finish(self) -> RequestRecord:
        """The record once the stream has ended; a stream without a timed chunk has no TTFT
        and fails."""
        record = self.record
        if self._last_chunk is None:
            record.error = "stream carried no chunk with choices"
            return record
        record.success = True
        record.latency = self._last_chunk - self._start
        record.generated_text = "".join(self._text)
        # A server that sends no usage: count the chunks that carried text (vLLM re-tokenizes
        # the text instead, which needs a tokenizer this client may not have).
        record.output_tokens = (self._completion_tokens if self._completion_tokens is not None
                                else self._num_text_chunks)
        return record


async def send_request(session: aiohttp.ClientSession, url: str, headers: dict[str, str],
                       payload: dict, request: BenchRequest) -> RequestRecord:
    """Run one request; HTTP errors and exceptions are recorded in the result, never raised."""
    start = time.perf_counter()
    timer = StreamTimer(request, start)
    try:
        async with session.post(url, json=payload, headers=headers) as response:
            if response.status != 200:
                body = await response.text()
                timer.record.error = f"HTTP {response.status}: {body[:500]}"
                return timer.record
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
                    timer.record.error = f"stream error: {data['error']}"
                    return timer.record
                timer.on_event(data, time.perf_counter())
    except Exception as e:  # a load generator reports failures; it must not stop on one
        timer.record.error = f"{type(e).__name__}: {e}"
        return timer.record
    return timer.finish()

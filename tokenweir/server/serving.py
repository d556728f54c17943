"""Serving one generation request: admit it, translate it, hand it to the engine, answer it as
one JSON body or as an SSE stream. A client that disconnects aborts its request, freeing its KV
blocks. Depends on the engine only through `EngineClient`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tokenweir.engine.client import EngineClient, EngineDeadError, OutputStream, RequestFailedError
from tokenweir.request import ParameterError
from tokenweir.server.admission import Admission, WaitingSlot
from tokenweir.server.auth import KeyGrant, authenticated_grant
from tokenweir.server.errors import APIError, bad_request, engine_error
from tokenweir.server.formatters import ChatFormatter, CompletionFormatter, ResponseFormatter, usage
from tokenweir.server.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse, GenerationRequest
from tokenweir.server.translate import EngineRequest, RequestTranslator


async def _abort_on_disconnect(request: Request, client: EngineClient, request_id: str) -> None:
    """Abort the request when its client goes away. uvicorn also answers `http.disconnect`
    once the response is complete; the abort of a finished request is a no-op."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    client.abort(request_id)


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


@dataclass
class _Job:
    """One accepted request, and how to answer it."""

    request_id: str
    created: int  # Unix time, as OpenAI's `created`
    model: str
    formatter: ResponseFormatter
    include_usage: bool
    outputs: OutputStream
    watcher: asyncio.Task[None]

    def envelope(self, choices: list[dict[str, Any]], chunk: bool) -> dict[str, Any]:
        return self.formatter.envelope(self.request_id, self.created, self.model, choices, chunk)


class OpenAIServing:
    def __init__(self, client: EngineClient, max_waiting_requests: Optional[int]) -> None:
        self.client = client
        self.model = client.model_info
        self.translator = RequestTranslator(client.model_info, client.tokenizer)
        self.admission = Admission(client, max_waiting_requests)

    def check_model(self, model: Optional[str]) -> None:
        if model is not None and model != self.model.name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves "
                                f"`{self.model.name}`.", param="model", code="model_not_found")

    async def completions(self, body: CompletionRequest, raw: Request) -> Response:
        return await self._serve("cmpl", body, raw, self.translator.completion, CompletionFormatter)

    async def chat_completions(self, body: ChatCompletionRequest, raw: Request) -> Response:
        return await self._serve("chatcmpl", body, raw, self.translator.chat, ChatFormatter)

    async def _serve(self, prefix: str, body: GenerationRequest, raw: Request,
                     translate: Callable[[Any, Optional[KeyGrant]], Awaitable[EngineRequest]],
                     formatter_class: type[ResponseFormatter]) -> Response:
        self.check_model(body.model)
        slot = self.admission.reserve()
        try:
            request = await translate(body, authenticated_grant(raw))
            formatter = formatter_class(self.client.tokenizer, request.params.logprobs)
            job = await self._submit(prefix, body, raw, request, formatter, slot)
        finally:
            slot.release()
        return await self._respond(job, body.stream)

    async def _submit(self, prefix: str, body: GenerationRequest, raw: Request, request: EngineRequest,
                      formatter: ResponseFormatter, slot: WaitingSlot) -> _Job:
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        created = int(time.time())
        slot.release()  # the engine counts the request as waiting from this call on (Admission)
        try:
            outputs = await self.client.add_request(request_id, request.prompt_ids, request.params,
                                                    request.hints, prompt_text=request.prompt_text)
        except ValueError as e:  # the prompt's, unless it names another field
            raise bad_request(str(e), e.param if isinstance(e, ParameterError) else request.prompt_param) from e
        except (EngineDeadError, RequestFailedError) as e:
            raise engine_error(e) from e
        watcher = asyncio.create_task(_abort_on_disconnect(raw, self.client, request_id))
        return _Job(request_id, created, self.model.name, formatter, body.include_usage, outputs, watcher)

    async def _respond(self, job: _Job, stream: bool) -> Response:
        if stream:
            return StreamingResponse(self._stream(job), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return JSONResponse(await self._complete(job))

    async def _stream(self, job: _Job) -> AsyncIterator[str]:
        """SSE chunks: text deltas of the cumulative outputs, then usage (if asked), [DONE].

        A chunk goes out when an output adds text, finishes the request, or adds tokens whose
        logprobs were asked for. A chat stream's first chunk names the role, carries the text
        of the engine's first output (its first token; possibly none) and waits for it, as
        vLLM's server waits with its role chunk: a client that times the first chunk
        (`vllm bench serve`) then measures time to first token, not time to acceptance.
        """
        formatter = job.formatter
        usage_field = {"usage": None} if job.include_usage else {}
        num_chars = num_tokens = 0
        try:
            final = None
            async for output in job.outputs:
                completion = output.outputs[0]
                delta = completion.text[num_chars:]
                logprobs = formatter.logprobs_since(output, num_tokens)
                new_tokens = len(completion.token_ids) > num_tokens
                opening = formatter.sends_opening_chunk and final is None
                if opening or delta or output.finished or (logprobs is not None and new_tokens):
                    choice = formatter.choice(output, delta, logprobs, chunk=True, opening=opening)
                    yield _sse({**job.envelope([choice], chunk=True), **usage_field})
                num_chars, num_tokens = len(completion.text), len(completion.token_ids)
                final = output
            if job.include_usage and final is not None:
                yield _sse({**job.envelope([], chunk=True), "usage": usage(final)})
        except Exception as e:  # headers are sent: the error can only travel as an event
            yield _sse(ErrorResponse(error=engine_error(e).info).model_dump())
        finally:
            job.watcher.cancel()
            await job.outputs.aclose()
        yield "data: [DONE]\n\n"

    async def _complete(self, job: _Job) -> dict[str, Any]:
        final = None
        try:
            async for output in job.outputs:
                final = output
        except (RequestFailedError, EngineDeadError) as e:
            raise engine_error(e) from e
        finally:
            job.watcher.cancel()
            await job.outputs.aclose()
        assert final is not None and final.finished
        text = final.outputs[0].text
        choice = job.formatter.choice(final, text, job.formatter.logprobs_since(final, 0), chunk=False)
        return {**job.envelope([choice], chunk=False), "usage": usage(final)}

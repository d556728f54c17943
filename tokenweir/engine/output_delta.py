"""RequestOutputs as deltas, for the pipe between the engine process and the server's.

Outputs are cumulative (every token and logprob so far), which costs nothing to hand across a
thread but is quadratic to pickle: a 2,000-token stream with logprobs would ship its whole
history at every step. The engine process sends what is new since the request's last output;
the server's process rebuilds the cumulative output, with lists of its own, as the in-process
engine hands them out.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Union

from tokenweir.engine.output import CompletionOutput, RequestMetrics, RequestOutput


@dataclass
class OutputDelta:
    request_id: str
    prompt: Optional[tuple[Optional[str], list[int]]]  # (prompt, prompt ids) in a request's first delta only
    new_token_ids: list[int]
    text_kept: int  # characters of the previous text that stay (the rest is replaced by text_new)
    text_new: str
    new_logprobs: Optional[list[dict[int, float]]]
    finish_reason: Optional[str]
    stop_reason: Union[None, int, str]
    cumulative_logprob: Optional[float]
    finished: bool
    metrics: RequestMetrics
    status_message: Optional[str] = None


class OutputDeltaEncoder:
    """The engine process's side: what it has sent of each unfinished request."""

    def __init__(self) -> None:
        self._sent: dict[str, tuple[int, int, str]] = {}  # tokens, logprobs, text

    def encode(self, output: RequestOutput) -> OutputDelta:
        rid = output.request_id
        completion = output.outputs[0]
        sent = self._sent.get(rid)
        num_tokens, num_logprobs, text = sent or (0, 0, "")
        kept = len(text) if completion.text.startswith(text) else 0
        delta = OutputDelta(
            rid, None if sent else (output.prompt, output.prompt_token_ids),
            completion.token_ids[num_tokens:], kept, completion.text[kept:],
            None if completion.logprobs is None else completion.logprobs[num_logprobs:],
            completion.finish_reason, completion.stop_reason, completion.cumulative_logprob,
            output.finished, output.metrics, output.status_message)
        if output.finished:
            self._sent.pop(rid, None)
        else:
            self._sent[rid] = (len(completion.token_ids), len(completion.logprobs or ()), completion.text)
        return delta

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)


class OutputDeltaDecoder:
    """The server's side: the last cumulative output of each unfinished request."""

    def __init__(self) -> None:
        self._last: dict[str, RequestOutput] = {}

    def decode(self, delta: OutputDelta) -> RequestOutput:
        last = self._last.get(delta.request_id)
        if last is None:
            if delta.prompt is None:
                raise RuntimeError(f"an output delta for {delta.request_id!r} without its request's first")
            prompt, prompt_token_ids = delta.prompt
            token_ids: list[int] = []
            text = ""
            logprobs: Optional[list[dict[int, float]]] = None
        else:
            prompt, prompt_token_ids = last.prompt, last.prompt_token_ids
            previous = last.outputs[0]
            token_ids, text, logprobs = previous.token_ids, previous.text, previous.logprobs
        completion = CompletionOutput(
            index=0, text=text[:delta.text_kept] + delta.text_new, token_ids=token_ids + delta.new_token_ids,
            finish_reason=delta.finish_reason, stop_reason=delta.stop_reason,
            logprobs=None if delta.new_logprobs is None else (logprobs or []) + delta.new_logprobs,
            cumulative_logprob=delta.cumulative_logprob)
        # The prompt ids are shared by a request's outputs (no one appends to them); the lists
        # that grow are new in every output, so an output a consumer holds never changes.
        output = RequestOutput(delta.request_id, prompt, prompt_token_ids, [completion], delta.finished,
                               dataclasses.replace(delta.metrics), delta.status_message)
        if delta.finished:
            self._last.pop(delta.request_id, None)
        else:
            self._last[delta.request_id] = output
        return output

    def forget(self, request_id: str) -> None:
        self._last.pop(request_id, None)

    def clear(self) -> None:
        self._last.clear()

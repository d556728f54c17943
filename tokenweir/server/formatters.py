"""The two response formats: a completion's (`text_completion`) and a chat completion's.

A formatter turns one request's outputs into its endpoint's choices, envelopes and logprobs;
`serving.py` decides when a chunk goes out and works the same for both. One formatter per
request: a completion's logprobs count text offsets across the chunks of a stream.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Optional

from tokenweir.engine.output import RequestOutput


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: kv[1], reverse=True)[:k]


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE (GPT-2's, SmolLM2's) spells each byte as one character: the printable
    Latin-1 bytes as themselves, the other 68 as the characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


_BYTE_LEVEL = _byte_level_alphabet()


def usage(output: RequestOutput) -> dict[str, int]:
    prompt, completion = len(output.prompt_token_ids), len(output.outputs[0].token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _with(top: list[tuple[int, float]], token_id: int, logprob: float) -> list[tuple[int, float]]:
    return top if any(t == token_id for t, _ in top) else [*top, (token_id, logprob)]


class ResponseFormatter(ABC):
    object_name: str
    chunk_object_name: str
    # A chat stream's first chunk names the role and goes out even without text.
    sends_opening_chunk: bool = False

    def __init__(self, tokenizer: Any, num_logprobs: Optional[int]) -> None:
        self.tokenizer = tokenizer
        self.num_logprobs = num_logprobs  # None: no logprobs asked for
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.byte_level = type(decoder).__name__ == "ByteLevel"

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's own bytes: for byte-level BPE read from its piece, so that a character
        split across tokens (a CJK character, an emoji) is rebuilt from the tokens' bytes, which
        is what OpenAI's `bytes` is for (a lone token decodes to U+FFFD there). Other tokenizers:
        the UTF-8 of its text."""
        if self.byte_level:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(c in _BYTE_LEVEL for c in piece):
                return [_BYTE_LEVEL[c] for c in piece]
        return list(self.token_text(token_id).encode())

    def envelope(self, request_id: str, created: int, model: str, choices: list[dict[str, Any]],
                 chunk: bool) -> dict[str, Any]:
        return {"id": request_id, "object": self.chunk_object_name if chunk else self.object_name,
                "created": created, "model": model, "choices": choices}

    def choice(self, output: RequestOutput, text: str, logprobs: Any, *, chunk: bool,
               opening: bool = False) -> dict[str, Any]:
        completion = output.outputs[0]
        body = self.chunk_body(text, opening) if chunk else self.full_body(text)
        return {"index": 0, **body, "logprobs": logprobs,
                "finish_reason": completion.finish_reason if output.finished else None,
                "stop_reason": completion.stop_reason if output.finished else None}

    def logprobs_since(self, output: RequestOutput, start: int) -> Any:
        """Logprobs of the tokens from `start` on, or None when none were asked for."""
        completion = output.outputs[0]
        if self.num_logprobs is None or completion.logprobs is None:
            return None
        ids = completion.token_ids[start:]
        # Stop at this output's own tokens, whatever the engine has appended since.
        entries = completion.logprobs[start:len(completion.token_ids)]
        return self.format_logprobs(ids, entries, self.num_logprobs)

    @abstractmethod
    def full_body(self, text: str) -> dict[str, Any]: ...

    @abstractmethod
    def chunk_body(self, text: str, opening: bool) -> dict[str, Any]: ...

    @abstractmethod
    def format_logprobs(self, ids: list[int], entries: list[dict[int, float]], k: int) -> Any: ...


class CompletionFormatter(ResponseFormatter):
    object_name = chunk_object_name = "text_completion"

    def __init__(self, tokenizer: Any, num_logprobs: Optional[int]) -> None:
        super().__init__(tokenizer, num_logprobs)
        self.text_offset = 0  # where the next token's text starts in the completion

    def full_body(self, text: str) -> dict[str, Any]:
        return {"text": text}

    def chunk_body(self, text: str, opening: bool) -> dict[str, Any]:
        return {"text": text}

    def format_logprobs(self, ids: list[int], entries: list[dict[int, float]], k: int) -> Any:
        strings = [self.token_text(t) for t in ids]
        offsets = []
        for s in strings:
            offsets.append(self.text_offset)
            self.text_offset += len(s)
        # As OpenAI's legacy `logprobs`: the sampled token's logprob is always among them (up
        # to logprobs + 1 entries).
        return {"tokens": strings, "token_logprobs": [entry[t] for t, entry in zip(ids, entries)],
                "top_logprobs": [self._by_text(_with(_top(entry, k), t, entry[t])) for t, entry in zip(ids, entries)],
                "text_offset": offsets}

    def _by_text(self, top: list[tuple[int, float]]) -> dict[str, float]:
        """Top logprobs keyed by token text; where two ids spell the same text, the likelier
        one stays."""
        result: dict[str, float] = {}
        for token_id, lp in top:
            result.setdefault(self.token_text(token_id), lp)
        return result


class ChatFormatter(ResponseFormatter):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    sends_opening_chunk = True

    def full_body(self, text: str) -> dict[str, Any]:
        return {"message": {"role": "assistant", "content": text}}

    def chunk_body(self, text: str, opening: bool) -> dict[str, Any]:
        if opening:
            return {"delta": {"role": "assistant", "content": text}}
        return {"delta": {"content": text} if text else {}}

    def format_logprobs(self, ids: list[int], entries: list[dict[int, float]], k: int) -> Any:
        def entry_of(token_id: int, lp: float) -> dict[str, Any]:
            return {"token": self.token_text(token_id), "logprob": lp, "bytes": self.token_bytes(token_id)}

        return {"content": [{**entry_of(t, entry[t]), "top_logprobs": [entry_of(i, lp) for i, lp in _top(entry, k)]}
                            for t, entry in zip(ids, entries)]}

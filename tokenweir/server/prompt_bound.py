"""A lower bound on a text's token count, known without tokenizing it.

Tokenizing a 10 MB prompt takes seconds of CPU and a gigabyte of memory, only to learn it does
not fit. For a byte-level BPE tokenizer without a normalizer (GPT-2's, Llama 3's, SmolLM2's)
every byte of the text lands in exactly one token, and a token spells at most N bytes, N being
the longest token of the vocabulary (its byte-level string has one character per byte) or the
longest added token (matched in the raw text). A character is at least one byte, so a text of
C characters has at least ceil(C / N) tokens: a prompt rejected on this bound can never fit.

Tokenizers that may drop or merge characters (a normalizer, whitespace splitting, word-level
`<unk>`, added tokens that strip their surroundings) have no such bound: `None`, and the
prompt is tokenized before its length is checked (the body size limit still caps the work).
"""

from __future__ import annotations

import json
from typing import Any, Optional

# Pre-tokenizers that keep every byte of the text (ByteLevel maps bytes to characters 1:1).
_LOSSLESS_SPLITTERS = {"ByteLevel", "Digits"}
_SPLITTERS_WITH_BEHAVIOR = {"Split", "Punctuation"}  # lossless unless behavior is "Removed"


def _pre_tokenizers(pre: Optional[dict[str, Any]]) -> list[dict[str, Any]]:
    if pre is None:
        return []
    if pre["type"] == "Sequence":
        return [p for inner in pre["pretokenizers"] for p in _pre_tokenizers(inner)]
    return [pre]


def _keeps_every_byte(pre: dict[str, Any]) -> bool:
    if pre["type"] in _LOSSLESS_SPLITTERS:
        return True
    return pre["type"] in _SPLITTERS_WITH_BEHAVIOR and pre.get("behavior") != "Removed"


def max_chars_per_token(tokenizer: Any) -> Optional[int]:
    """The most characters of text one token can stand for, or None if unbounded."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    state = json.loads(backend.to_str())
    model = state["model"]
    pres = _pre_tokenizers(state.get("pre_tokenizer"))
    if (state.get("normalizer") is not None or model.get("type") != "BPE" or model.get("fuse_unk")
            or not any(p["type"] == "ByteLevel" for p in pres) or not all(map(_keeps_every_byte, pres))):
        return None
    added = state.get("added_tokens", [])
    if any(a.get("lstrip") or a.get("rstrip") for a in added):
        return None
    return max([len(token) for token in model["vocab"]] + [len(a["content"]) for a in added])


def min_num_tokens(num_chars: int, chars_per_token: int) -> int:
    return -(-num_chars // chars_per_token)

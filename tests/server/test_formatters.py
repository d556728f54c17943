"""Logprob fields against OpenAI's meaning, with the default model's byte-level BPE tokenizer."""

from __future__ import annotations

import pytest

from tokenweir.server.formatters import ChatFormatter

TEXT = "Tokyo 東京 🙂 naïve"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from tokenweir.model.gguf_conversion import ensure_hf_folder
    from tokenweir.model.loader import default_model_path

    return AutoTokenizer.from_pretrained(ensure_hf_folder(default_model_path()))


def test_chat_bytes_rebuild_characters_split_across_tokens(tokenizer):
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids), "the text must split a character across tokens"
    entries = [{t: -1.0, (t + 1) % tokenizer.vocab_size: -2.0} for t in ids]
    content = ChatFormatter(tokenizer, 1).format_logprobs(ids, entries, 1)["content"]
    assert bytes(b for item in content for b in item["bytes"]).decode() == TEXT
    # Each top entry carries its own token's bytes too.
    assert all(item["top_logprobs"][0]["bytes"] == item["bytes"] for item in content)

"""Incremental detokenization and stop strings with the real default model's byte-level BPE
tokenizer: multi-byte characters split across tokens are never cut in half."""

from __future__ import annotations

import pytest

from tokenweir.engine.output import OutputProcessor
from tokenweir.request import Request, RequestStatus, SamplingParams

TEXT = "Olá, café ☕ naïve résumé 🎉🎉 done."


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from tokenweir.model.gguf_conversion import ensure_hf_folder
    from tokenweir.model.loader import default_model_path

    return AutoTokenizer.from_pretrained(ensure_hf_folder(default_model_path()))


def stream(tokenizer, text, **params):
    """Feed `text`'s tokens one by one; return (texts shown after each token, state, request)."""
    processor = OutputProcessor(tokenizer)
    request = Request("r", tokenizer.encode("Say:"), SamplingParams(max_tokens=100, **params))
    state = processor.new_state(request, "Say:")
    shown = []
    for i, token in enumerate(tokenizer.encode(text)):
        request.append_output_token(token, now=float(i))
        if processor.process_tokens(state, 1):
            request.status = RequestStatus.FINISHED_STOPPED
            shown.append(processor.make_output(state).outputs[0].text)
            break
        shown.append(processor.make_output(state).outputs[0].text)
    return shown, state, request


def test_multibyte_characters_are_never_split(tokenizer):
    ids = tokenizer.encode(TEXT)
    assert any("\ufffd" in tokenizer.decode(ids[:i]) for i in range(1, len(ids))), \
        "the test text must contain characters split across tokens"
    shown, _, _ = stream(tokenizer, TEXT)
    assert all("\ufffd" not in s for s in shown)
    assert all(b.startswith(a) for a, b in zip(shown, shown[1:]))  # text only grows
    assert shown[-1] == TEXT


def test_stop_string_after_multibyte_text(tokenizer):
    shown, state, _ = stream(tokenizer, TEXT, stop=["🎉"])
    assert shown[-1] == "Olá, café ☕ naïve résumé " and state.stop_reason == "🎉"


def test_running_text_holds_back_a_possible_stop_prefix(tokenizer):
    stop = "four five six"
    shown, state, request = stream(tokenizer, "one two three four five", stop=[stop])
    # While running, the last len(stop) - 1 characters stay back: they could start the stop.
    assert shown[-1] == "one two three four five"[:-(len(stop) - 1)]
    request.status = RequestStatus.FINISHED_LENGTH
    assert OutputProcessor(tokenizer).make_output(state).outputs[0].text == "one two three four five"


def test_the_processor_reports_a_stop_string_finish_and_a_failure(tokenizer):
    processor = OutputProcessor(tokenizer)
    requests = [Request(rid, tokenizer.encode("Say:"), SamplingParams(max_tokens=100, stop=["two"]))
                for rid in ("stops", "runs", "breaks")]
    states = [processor.new_state(r, "Say:") for r in requests]
    for request, text in zip(requests, (" one two", " one", " one")):
        for token in tokenizer.encode(text):
            request.append_output_token(token, now=0.0)
    requests[2].sampling_params.stop = [None]  # corrupt: checking its stop strings raises
    items = [(s, r.num_output_tokens, None) for s, r in zip(states, requests)]
    result = processor.process_step(items)
    assert result.finished == {"stops": RequestStatus.FINISHED_STOPPED}
    assert list(result.failed) == ["breaks"]
    # The output says why the text ends, whatever status the scheduler gave the request.
    requests[0].status = RequestStatus.FINISHED_LENGTH
    assert processor.make_output(states[0]).outputs[0].finish_reason == "stop"


WORDS = " one two three four five six seven eight"
STOPS = ["two", "o", "e f", "four five six", "ix", "six seven", "t", "ight", "n"]


def cut_by_reference(tokenizer, text, stops, min_tokens, include):
    """Read the text character by character: the first stop string to complete past the text
    the first min_tokens tokens wrote ends it (of two completing at one character, the longer)."""
    ids = tokenizer.encode(text)
    full, held = tokenizer.decode(ids), len(tokenizer.decode(ids[:min_tokens]))
    matches = [(i + len(s), i, s) for s in stops for i in range(len(full)) if full.startswith(s, i)
               and i + len(s) > held]
    if not matches:
        return full, None
    end, start, stop = min(matches)
    return full[:end if include else start], stop


@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_end_the_text_where_read_character_by_character(tokenizer, include):
    """Every pair of stops and every min_tokens: shorter stops inside text written while
    min_tokens held the search back do not count, and of two stops one token completes, the one
    that ends first (then the longer) wins, whatever their order in the list."""
    num_tokens = len(tokenizer.encode(WORDS))
    for i, first in enumerate(STOPS):
        for second in STOPS[i + 1:]:
            for stops in ([first, second], [second, first]):
                for min_tokens in range(num_tokens):
                    _, state, _ = stream(tokenizer, WORDS, stop=stops, min_tokens=min_tokens,
                                         include_stop_str_in_output=include)
                    want_text, want_stop = cut_by_reference(tokenizer, WORDS, stops, min_tokens, include)
                    assert (state.text, state.stop_reason) == (want_text, want_stop), (stops, min_tokens)

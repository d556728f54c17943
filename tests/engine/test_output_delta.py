"""Output deltas (engine process -> server): decoding what was encoded gives back every
cumulative output, whatever the text, tokens and logprobs did between two outputs."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenweir.engine.output import CompletionOutput, RequestMetrics, RequestOutput
from tokenweir.engine.output_delta import OutputDeltaDecoder, OutputDeltaEncoder


def output(rid: str, tokens: list[int], text: str, logprobs, finished: bool) -> RequestOutput:
    completion = CompletionOutput(0, text, list(tokens), "length" if finished else None, None,
                                  None if logprobs is None else [dict(lp) for lp in logprobs],
                                  None if logprobs is None else -1.5 * len(tokens))
    # A finished request says why when the engine ended it (a shed one): carried across too.
    return RequestOutput(rid, "prompt", [1, 2, 3], [completion], finished,
                         RequestMetrics(0.0, 0.1, 0.2 if tokens else None, 1.0 if finished else None, 0, 0),
                         f"reason of {rid}" if finished and len(tokens) % 2 else None)


# Each step: new tokens, and what happens to the text: grows, or is cut back (a stop string).
steps = st.lists(st.tuples(st.integers(0, 3), st.booleans(), st.text(max_size=4)), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(requests=st.lists(steps, min_size=1, max_size=3), with_logprobs=st.booleans())
def test_decoded_outputs_equal_the_cumulative_ones(requests, with_logprobs):
    encoder, decoder = OutputDeltaEncoder(), OutputDeltaDecoder()
    held = []
    for r, request_steps in enumerate(requests):
        tokens: list[int] = []
        logprobs: list[dict[int, float]] = []
        text = ""
        for i, (num_new, cut, piece) in enumerate(request_steps):
            for _ in range(num_new):
                tokens.append(len(tokens))
                logprobs.append({len(tokens): -0.5, 7: -2.0})
            text = (text[: len(text) // 2] if cut else text) + piece
            finished = i == len(request_steps) - 1
            want = output(f"r{r}", tokens, text, logprobs if with_logprobs else None, finished)
            got = decoder.decode(encoder.encode(want))
            assert got == want
            held.append((got, want))
    # Every request finished: neither side keeps anything; outputs handed out never changed.
    assert encoder._sent == {} and decoder._last == {}
    for got, want in held:
        assert got == want
    outputs = [got for got, _ in held]
    assert len({id(o.outputs[0].token_ids) for o in outputs}) == len(outputs)


def test_a_failed_request_is_forgotten_on_both_sides():
    encoder, decoder = OutputDeltaEncoder(), OutputDeltaDecoder()
    decoder.decode(encoder.encode(output("a", [1], "x", None, False)))
    encoder.forget("a")
    decoder.forget("a")
    assert encoder._sent == {} and decoder._last == {}
    # A new request under the same id starts from nothing.
    again = output("a", [9], "y", None, True)
    assert decoder.decode(encoder.encode(again)) == again

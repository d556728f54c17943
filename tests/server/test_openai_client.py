"""The official openai client against the server: completions and chat, streamed and not."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import tokenweir
from tests.server.conftest import wait_until
from tests.server.helpers import MODEL, async_client, client, scrape, value

PROMPT = "the capital of france is"
MESSAGES = [{"role": "user", "content": "what is the capital of france ?"}]
# Sampled with a seed: the tiny random model's greedy picks are often ids its word-level
# tokenizer cannot spell, while seeded samples give text and are just as reproducible.
SEEDED = dict(temperature=1.0, seed=7)


def chat_prompt_ids(engine, messages) -> list[int]:
    text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return engine.tokenizer.encode(text, add_special_tokens=False)


def test_models_health_version(server):
    models = client(server).models.list().data
    assert [m.id for m in models] == [MODEL]
    assert httpx.get(f"{server}/health").status_code == 200
    assert httpx.get(f"{server}/version").json() == {"version": tokenweir.__version__}


def test_completion_streamed_and_not(server, engine):
    c = client(server)
    full = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, extra_body={"ignore_eos": True},
                                **SEEDED)
    assert full.id.startswith("cmpl-") and full.object == "text_completion" and full.model == MODEL
    num_prompt = len(engine.tokenizer.encode(PROMPT, add_special_tokens=True))
    assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) == (
        num_prompt, 12, num_prompt + 12)
    assert full.choices[0].finish_reason == "length" and full.choices[0].text

    chunks = list(c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True}, **SEEDED))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == full.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == full.usage
    assert all(ch.usage is None for ch in chunks[:-1])


def test_chat_streamed_and_not(server, engine):
    c = client(server)
    full = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_completion_tokens=10,
                                     extra_body={"ignore_eos": True}, **SEEDED)
    assert full.id.startswith("chatcmpl-") and full.object == "chat.completion"
    assert full.choices[0].message.role == "assistant" and full.choices[0].message.content
    assert full.usage.prompt_tokens == len(chat_prompt_ids(engine, MESSAGES))
    assert full.usage.completion_tokens == 10

    chunks = list(c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}, **SEEDED))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage == full.usage


def test_chat_stream_opens_with_the_first_token(server, engine, gate):
    # The role chunk waits for the engine's first output, so a client timing the first chunk
    # measures time to first token. The engine is held before its first step here.
    # With logprobs a chunk goes out for every output, so the opening chunk must carry the
    # first token's logprob (a role chunk sent on acceptance would carry none). Outputs the
    # stream reads late are merged, so later chunks may hold several tokens: only the total is 4.
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "stream": True, "ignore_eos": True,
            "logprobs": True, **SEEDED}
    events: list[dict] = []

    def read() -> None:
        with httpx.stream("POST", f"{server}/v1/chat/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line.removeprefix("data: ")))

    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(read)
        wait_until(lambda: engine.num_waiting_requests() == 1, "the request to wait")
        time.sleep(0.3)  # a role chunk sent on acceptance would be here by now
        assert events == []
        gate.set()
        done.result()
    choices = [e["choices"][0] for e in events if e["choices"]]
    assert choices[0]["delta"]["role"] == "assistant" and all("role" not in c["delta"] for c in choices[1:])
    counts = [len(c["logprobs"]["content"]) for c in choices]
    assert counts[0] >= 1 and sum(counts) == 4


def test_stop_string_cuts_the_text(server):
    c = client(server)
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=24, extra_body={"ignore_eos": True}, **SEEDED)
    text = c.completions.create(**kwargs).choices[0].text
    words = text.split()
    assert len(words) >= 4, text
    stop = words[len(words) // 2]
    cut = c.completions.create(**kwargs, stop=[stop, "no such words here"]).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == text[:text.index(stop)]
    streamed = c.completions.create(**kwargs, stop=stop, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed) == cut.text


def test_seeded_sampling_is_reproducible_under_concurrency(server):
    async def run():
        ac = async_client(server)
        def one(seed):
            return ac.completions.create(model=MODEL, prompt="hello world", max_tokens=16, temperature=1.0,
                                         seed=seed, logprobs=1, extra_body={"ignore_eos": True})
        outs = await asyncio.gather(one(1234), one(99), one(1234), one(4321))
        await ac.close()
        return outs

    a, _, b, d = asyncio.run(run())
    assert a.choices[0].text == b.choices[0].text
    # Batch shapes differ between the runs, so logprobs agree only to float precision.
    assert a.choices[0].logprobs.tokens == b.choices[0].logprobs.tokens
    assert a.choices[0].logprobs.token_logprobs == pytest.approx(b.choices[0].logprobs.token_logprobs, abs=1e-4)
    assert a.choices[0].logprobs.token_logprobs != pytest.approx(d.choices[0].logprobs.token_logprobs, abs=1e-4)


def test_logprobs(server):
    c = client(server)
    out = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                               extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    # Greedy: the sampled token is the most likely one. (Several ids the tiny tokenizer cannot
    # spell share the text "", so a dict keyed by text may hold fewer than 3 entries.)
    for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and token_lp == pytest.approx(max(top.values()))
        assert top[token] == pytest.approx(token_lp)

    # Sampled: the sampled token's logprob is always there, as in OpenAI's legacy logprobs (up
    # to logprobs + 1 entries), whether or not it is among the best.
    out = c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=2.0, logprobs=1,
                               seed=7, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    # (Keyed by text: where another id spells the same text, the likelier one's logprob stays.)
    assert all(token in top and top[token] >= token_lp - 1e-6 and 1 <= len(top) <= 2
               for token, token_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs))
    assert any(token_lp < max(top.values()) for token_lp, top in zip(lp.token_logprobs, lp.top_logprobs))

    chat = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, logprobs=True,
                                     top_logprobs=2, extra_body={"ignore_eos": True}, **SEEDED)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob <= 0 for t in content)


def test_request_fields_reach_the_engine(server, engine, monkeypatch):
    seen = []
    add_request = engine.core.add_request

    def spy(*args, **kwargs):
        request = add_request(*args, **kwargs)
        seen.append(request)
        return request

    monkeypatch.setattr(engine.core, "add_request", spy)
    client(server).completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, top_p=0.9, seed=5, presence_penalty=0.5, frequency_penalty=-1,
        logit_bias={"9": -100, "12": 3.5},
        extra_body={"priority": 3, "tenant": "acme", "deadline_ms": 5000, "ttft_slo_ms": 200,
                    "tpot_slo_ms": 50, "top_k": 5, "min_p": 0.05, "min_tokens": 2, "stop_token_ids": [7],
                    "ignore_eos": True, "repetition_penalty": 1.25})
    (request,) = seen
    assert (request.priority, request.tenant) == (3, "acme")
    assert request.deadline - request.arrival_time == pytest.approx(5.0)
    assert (request.ttft_slo, request.tpot_slo) == (pytest.approx(0.2), pytest.approx(0.05))
    p = request.sampling_params
    assert (p.max_tokens, p.top_p, p.top_k, p.min_p, p.min_tokens, p.seed, p.stop_token_ids, p.ignore_eos) == (
        3, 0.9, 5, 0.05, 2, 5, [7], True)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.logit_bias) == (
        0.5, -1, 1.25, {9: -100, 12: 3.5})


def test_logit_bias_steers_a_greedy_chat(server, engine):
    """A +100 bias on one token makes greedy produce only it; the others' answers are untouched."""
    c = client(server)
    messages = [{"role": "user", "content": "hi"}]
    plain = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    token = 42
    biased = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                       logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    # (decoded after the prompt, the word keeps the space its token starts with)
    assert biased.choices[0].message.content.split() == [engine.tokenizer.decode([token]).strip()] * 4
    again = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert again.choices[0].message.content == plain.choices[0].message.content


def test_cache_salt_isolates_prefix_caches(server):
    """vLLM's `cache_salt`: requests share cached prefix blocks only when their salts match."""
    c = client(server)
    prompt = " ".join(["the capital of france is paris"] * 8)  # several full KV blocks
    tag = uuid.uuid4().hex

    def served(salt):
        before = scrape(server)
        c.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={"cache_salt": salt})
        queried = value(before, "tokenweir:prefix_cache_queries_total")
        wait_until(lambda: value(scrape(server), "tokenweir:prefix_cache_queries_total") > queried,
                   "the prefix-cache lookup to be counted")
        return value(scrape(server), "tokenweir:prefix_cache_hits_total") - value(before, "tokenweir:prefix_cache_hits_total")

    assert served(f"alice-{tag}") == 0
    assert served(f"alice-{tag}") >= 32  # the same salt: its blocks are found
    assert served(f"bob-{tag}") == 0  # another salt: none of alice's blocks

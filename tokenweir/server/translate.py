"""Request translation: an OpenAI body -> what the engine takes (prompt, SamplingParams,
SchedulingHints), or a 400 naming the field.

Types and ranges are the schema's (protocol.py); here come the rules that need the model: the
prompt's length against `max_model_len` (first on a bound that needs no tokenizing, see
prompt_bound.py), the output budget, and the parameter checks of SamplingParams and
SchedulingHints, whose ParameterError names the field as the body spells it.

Tokenizing and rendering run in worker threads (asyncio.to_thread): a long prompt takes a while
and the event loop must keep other streams flowing. They may overlap: the Rust tokenizer's
encode only reads it, as long as every call passes the same truncation and padding settings.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any, Optional

from tokenweir.engine.client import ModelInfo
from tokenweir.request import (GENERATION_CONFIG_KEYS, ParameterError, SamplingParams, SchedulingHints,
                               resolve_max_tokens)
from tokenweir.server.auth import KeyGrant
from tokenweir.server.errors import APIError, bad_request
from tokenweir.server.prompt_bound import max_chars_per_token, min_num_tokens
from tokenweir.server.protocol import ChatCompletionRequest, CompletionRequest, GenerationRequest

# SchedulingHints' fields that the body spells differently (it takes milliseconds).
_HINT_PARAMS = {"deadline": "deadline_ms", "ttft_slo": "ttft_slo_ms", "tpot_slo": "tpot_slo_ms"}


@dataclass(frozen=True)
class EngineRequest:
    """One request as the engine takes it."""

    prompt_text: Optional[str]  # None for a prompt given as token ids
    prompt_ids: list[int]
    params: SamplingParams
    hints: SchedulingHints
    prompt_param: str  # the body field the prompt came from, for the engine's ValueErrors


def _parameter_error(error: ParameterError) -> APIError:
    param = _HINT_PARAMS.get(error.param, error.param)
    message = str(error) if param == error.param else f"invalid `{param}`: {error}"
    return bad_request(message, param)


def _seconds(ms: Optional[float]) -> Optional[float]:
    return None if ms is None else ms / 1000.0


class RequestTranslator:
    def __init__(self, model: ModelInfo, tokenizer: Any) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.chars_per_token = max_chars_per_token(tokenizer)

    async def completion(self, body: CompletionRequest, grant: Optional[KeyGrant] = None) -> EngineRequest:
        """`grant`: the authenticated key's (its tenant wins over the body's; its priority bounds
        the body's)."""
        arrival = time.monotonic()  # the engine's clock
        prompt = body.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise bad_request(f"prompt: batched prompts ({len(prompt)}) are not supported; "
                                  "send one prompt per request", "prompt")
            prompt = prompt[0]
        text: Optional[str] = None
        if isinstance(prompt, str):
            text = prompt
            ids = await asyncio.to_thread(self.encode, text, "prompt", True)
        else:
            ids = list(prompt)  # the engine checks the ids against the vocabulary
        max_tokens = self.resolve_max_tokens(body.max_tokens, "max_tokens", ids, "prompt")
        return self._request(body, text, ids, "prompt", max_tokens, body.logprobs, arrival, grant)

    async def chat(self, body: ChatCompletionRequest, grant: Optional[KeyGrant] = None) -> EngineRequest:
        arrival = time.monotonic()
        if body.top_logprobs is not None and not body.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        text, ids = await asyncio.to_thread(self.render_chat, body)
        if body.max_completion_tokens is not None:
            max_tokens = self.resolve_max_tokens(body.max_completion_tokens, "max_completion_tokens",
                                                 ids, "messages")
        else:
            max_tokens = self.resolve_max_tokens(body.max_tokens, "max_tokens", ids, "messages")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return self._request(body, text, ids, "messages", max_tokens, logprobs, arrival, grant)

    def _request(self, body: GenerationRequest, text: Optional[str], ids: list[int], prompt_param: str,
                 max_tokens: int, logprobs: Optional[int], arrival: float,
                 grant: Optional[KeyGrant]) -> EngineRequest:
        try:
            # A knob the body leaves unset: the model's default (generation_config.json), else
            # SamplingParams' own.
            given = {name: getattr(body, name) for name in GENERATION_CONFIG_KEYS}
            params = SamplingParams(
                max_tokens=max_tokens, min_tokens=body.min_tokens,
                **{**self.model.default_sampling_params, **{k: v for k, v in given.items() if v is not None}},
                presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
                logit_bias=None if body.logit_bias is None else {int(t): b for t, b in body.logit_bias.items()},
                stop=body.stop, stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
                seed=body.seed, logprobs=logprobs, include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=body.skip_special_tokens, n=body.n)
            hints = SchedulingHints(
                priority=body.priority if grant is None else grant.priority_of(body.priority),
                tenant=body.tenant if grant is None else grant.tenant, arrival_time=arrival,
                deadline=_seconds(body.deadline_ms), ttft_slo=_seconds(body.ttft_slo_ms),
                tpot_slo=_seconds(body.tpot_slo_ms),
                cache_salt=body.cache_salt if grant is None else _tenant_salt(grant.tenant, body.cache_salt))
        except ParameterError as e:
            raise _parameter_error(e) from e
        return EngineRequest(text, ids, params, hints, prompt_param)

    # ------------------------------------------------------------ lengths

    def check_text_fits(self, text: str, param: str) -> None:
        """Reject a text that has at least max_model_len tokens by the characters-per-token
        bound alone, before anything tokenizes it."""
        if self.chars_per_token is None:
            return
        at_least, limit = min_num_tokens(len(text), self.chars_per_token), self.model.max_model_len
        if at_least >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens, and `{param}` has at least "
                f"{at_least} tokens ({len(text)} characters; a token of this tokenizer spells at most "
                f"{self.chars_per_token}), which leaves no room for output. Please shorten `{param}`.",
                param)

    def resolve_max_tokens(self, max_tokens: Optional[int], max_tokens_param: str,
                           prompt_ids: list[int], prompt_param: str) -> int:
        """Check the prompt and output lengths against max_model_len, as vLLM does (400 rather
        than silently clamping); an unset max_tokens fills the rest of the context."""
        try:
            return resolve_max_tokens(len(prompt_ids), max_tokens, self.model.max_model_len,
                                      prompt_param=prompt_param, max_tokens_param=max_tokens_param)
        except ParameterError as e:
            raise bad_request(str(e), e.param) from None

    # ------------------------------------------------------------ worker threads

    def encode(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        self.check_text_fits(text, param)
        try:
            # The tokenizer rejects a lone surrogate (valid JSON: "\ud800") with a TypeError that
            # does not say why; str.encode names the character and where it is.
            text.encode("utf-8")
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        except (TypeError, ValueError) as e:
            raise bad_request(f"`{param}` cannot be tokenized: {e}", param) from e

    def render_chat(self, body: ChatCompletionRequest) -> tuple[str, list[int]]:
        messages = [m.for_template() for m in body.messages]
        # The rendered text holds every message's content: bound it before rendering, too.
        self.check_text_fits("".join(m["content"] for m in messages), "messages")
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # jinja errors, a template that rejects a role, no template
            raise bad_request(f"messages cannot be rendered by the model's chat template: {e}",
                              "messages") from e
        # The template already carries BOS where the model wants one (as LLM.chat does).
        return text, self.encode(text, "messages", add_special_tokens=False)


def _tenant_salt(tenant: str, salt: Optional[str]) -> str:
    """With a keys file the prefix cache is each tenant's own: the salt a request sends is
    joined to its key's tenant, so no tenant reuses another's cached blocks by naming its salt,
    or learns from the prefix-cache hit counters (which every key reads) whether another's
    prompt is cached. A hash keeps the salt within its length bound; the JSON pair keeps
    (tenant, salt) pairs apart."""
    return "tenant:" + hashlib.sha256(json.dumps([tenant, salt]).encode()).hexdigest()

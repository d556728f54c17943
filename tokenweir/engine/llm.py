"""The offline API: `LLM(...).generate(prompts, SamplingParams(...))`, as in vLLM."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence, TypeVar, Union

from tqdm.auto import tqdm

from tokenweir.config import EngineArgs
from tokenweir.core.scheduler import SchedulerStats
from tokenweir.engine.core import EngineCore
from tokenweir.engine.output import RequestOutput
from tokenweir.request import SamplingParams, SchedulingHints

# A string, or {"prompt": str} / {"prompt_token_ids": [...]} with an optional "cache_salt" (vLLM's).
PromptType = Union[str, dict[str, Any]]
Message = dict[str, str]


@dataclass(slots=True)
class _Prompt:
    text: Optional[str]  # what the output processor shows as the prompt
    prompt: Union[str, list[int]]  # what the engine tokenizes (or takes as ids)
    cache_salt: Optional[str] = None


T = TypeVar("T")
# A scheduling hint of `generate` / `chat`: one value for every prompt, or one per prompt.
PerPrompt = Union[None, T, Sequence[T]]


@dataclass(frozen=True, slots=True)
class _Hints:
    """The scheduling hints as given to `generate` / `chat`, before they are spread per prompt."""

    priority: PerPrompt[int]
    tenant: PerPrompt[Optional[str]]
    deadline: PerPrompt[Optional[float]]
    ttft_slo: PerPrompt[Optional[float]]
    tpot_slo: PerPrompt[Optional[float]]

    def per_prompt(self, prompts: Sequence[_Prompt]) -> list[SchedulingHints]:
        """One SchedulingHints per prompt, each built (and so validated) before anything is
        queued; an error names the prompt and the hint."""
        n = len(prompts)
        columns = {name: _spread(name, getattr(self, name), n, default) for name, default in _HINT_DEFAULTS.items()}
        hints = []
        for i, prompt in enumerate(prompts):
            try:
                hints.append(SchedulingHints(**{name: column[i] for name, column in columns.items()},
                                             cache_salt=prompt.cache_salt))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from e
        return hints


# What an unset hint means (a None inside a list is that prompt's value, checked as given).
_HINT_DEFAULTS: dict[str, object] = {"priority": 0, "tenant": None, "deadline": None, "ttft_slo": None,
                                     "tpot_slo": None}


def _spread(name: str, value: object, n: int, default: object) -> list[object]:
    """`value` for each of `n` prompts. A str is one tenant, not a sequence of them."""
    if value is None:
        return [default] * n
    if isinstance(value, (str, bool, int, float)):
        return [value] * n
    if not isinstance(value, Sequence):
        raise ValueError(f"{name} must be one value for every prompt or a list with one per prompt, "
                         f"got {type(value).__name__}")
    if len(value) != n:
        raise ValueError(f"got {len(value)} {name} values for {n} prompts")
    return list(value)


class LLM:
    def __init__(self, model: Optional[str] = None, **engine_kwargs: Any) -> None:
        unknown = set(engine_kwargs) - set(EngineArgs.field_names())
        if unknown:
            raise ValueError(f"unknown engine arguments: {sorted(unknown)}")
        self._init(EngineCore(EngineArgs(model=model, **engine_kwargs)))

    @classmethod
    def from_engine(cls, engine: EngineCore) -> "LLM":
        """Wrap an existing engine (e.g. one sharing already-loaded weights)."""
        llm = cls.__new__(cls)
        llm._init(engine)
        return llm

    def _init(self, engine: EngineCore) -> None:
        self.engine = engine
        self._counter = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use without sampling_params: SamplingParams' defaults,
        but for what the model's generation_config.json sets (`generation_config="auto"`)."""
        return SamplingParams(**self.engine.default_sampling_params)

    def generate(self, prompts: Union[PromptType, Sequence[PromptType]],
                 sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
                 priority: PerPrompt[int] = None, use_tqdm: bool = True, *,
                 tenant: PerPrompt[Optional[str]] = None, deadline: PerPrompt[Optional[float]] = None,
                 ttft_slo: PerPrompt[Optional[float]] = None,
                 tpot_slo: PerPrompt[Optional[float]] = None) -> list[RequestOutput]:
        """Run prompts (strings or {"prompt_token_ids": [...]}) to completion, in input order.

        The scheduling hints (what `scheduling_policy="sla"` / `"vtc"` schedule by, as the
        server's `priority`, `tenant`, `deadline_ms`, `ttft_slo_ms`, `tpot_slo_ms` do) take one
        value for every prompt or a list with one per prompt (None: not set). `priority`: an
        integer, smaller first; `tenant`: a name; `deadline` (finish within, from arrival),
        `ttft_slo`, `tpot_slo`: seconds."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        elif not isinstance(prompts, Iterable):
            raise ValueError("prompts must be a prompt (a string or a prompt dict) or a list of them, "
                             f"got {type(prompts).__name__}")
        prompts = list(prompts)
        hints = _Hints(priority, tenant, deadline, ttft_slo, tpot_slo)
        return self._run([self._prompt_of(p) for p in prompts], sampling_params, hints, use_tqdm)

    def chat(self, messages: Union[Sequence[Message], Sequence[Sequence[Message]]],
             sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]] = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, *,
             priority: PerPrompt[int] = None, tenant: PerPrompt[Optional[str]] = None,
             deadline: PerPrompt[Optional[float]] = None, ttft_slo: PerPrompt[Optional[float]] = None,
             tpot_slo: PerPrompt[Optional[float]] = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of them, through the model's
        chat template. The scheduling hints as in `generate`, one per conversation."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.engine.tokenizer.apply_chat_template(list(c), tokenize=False,
                                                             add_generation_prompt=add_generation_prompt)
                   for c in conversations]
        # The template already carries BOS where the model wants one.
        token_ids = [self.engine.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        return self._run([_Prompt(text, ids) for text, ids in zip(prompts, token_ids)], sampling_params,
                         _Hints(priority, tenant, deadline, ttft_slo, tpot_slo), use_tqdm)

    @staticmethod
    def _prompt_of(prompt: PromptType) -> _Prompt:
        if isinstance(prompt, str):
            return _Prompt(prompt, prompt)
        if isinstance(prompt, dict) and ("prompt_token_ids" in prompt) != ("prompt" in prompt):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
            if unknown:
                raise ValueError(f"unknown prompt keys {sorted(unknown)}; a prompt dict takes 'prompt' or "
                                 "'prompt_token_ids', and optionally 'cache_salt'")
            salt = prompt.get("cache_salt")
            if "prompt" in prompt:
                if not isinstance(prompt["prompt"], str):
                    raise ValueError(f"'prompt' must be a string, got {type(prompt['prompt']).__name__}")
                return _Prompt(prompt["prompt"], prompt["prompt"], salt)
            if not isinstance(prompt["prompt_token_ids"], (list, tuple)):
                raise ValueError("'prompt_token_ids' must be a list of token ids, "
                                 f"got {type(prompt['prompt_token_ids']).__name__}")
            return _Prompt(None, list(prompt["prompt_token_ids"]), salt)
        raise ValueError("a prompt must be a string, {'prompt': str} or {'prompt_token_ids': [...]} "
                         f"(optionally with 'cache_salt'), got {prompt!r:.80}")

    def _run(self, prompts: list[_Prompt],
             sampling_params: Union[None, SamplingParams, Sequence[SamplingParams]],
             given: _Hints, use_tqdm: bool) -> list[RequestOutput]:
        n = len(prompts)
        if sampling_params is None:
            params = [self.get_default_sampling_params()] * n
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * n
        else:
            params = list(sampling_params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
        if not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError(f"sampling_params must be SamplingParams or a list of them, got {sampling_params!r}")
        hints = given.per_prompt(prompts)

        engine = self.engine
        ids = [str(next(self._counter)) for _ in range(n)]
        try:
            for rid, prompt, p, h in zip(ids, prompts, params, hints):
                engine.add_request(rid, prompt.prompt, p, h, prompt_text=prompt.text)
            finished = self._run_to_completion(ids, use_tqdm)
        except BaseException:
            # A bad input, a failed step or Ctrl-C: none of this call's requests stays behind
            # (their blocks are freed; the runner drops their state at the next step).
            engine.abort_requests(ids)
            raise
        return [finished[rid] for rid in ids]

    def _run_to_completion(self, ids: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        engine = self.engine
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm) as bar:
            while len(finished) < len(ids):
                result = engine.step()
                for output in result.outputs:
                    if output.finished:
                        finished[output.request_id] = output
                        bar.update(1)
                if result.failed:
                    rid, error = next(iter(result.failed.items()))
                    raise RuntimeError(f"request {rid} failed in the engine: {error!r}") from error
        return finished

    def get_stats(self) -> SchedulerStats:
        return self.engine.get_stats()

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

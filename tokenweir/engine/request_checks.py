"""The engine's checks of a request's input, before anything is queued.

One set of checks for every place a request enters: EngineCore.add_request, and a cluster's
coordinator (cluster/coordinator.py), which must refuse a bad request with the same error the
replica would give, before it waits in the global queue. No torch here.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

from tokenweir.checks import is_integer
from tokenweir.request import ParameterError, ResumeState, SamplingParams, SchedulingHints


def tokenize(tokenizer: Any, prompt: Union[str, list[int]]) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=True)
    if not isinstance(prompt, (list, tuple)):
        raise ValueError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
    return list(prompt)


def check_prompt(prompt_token_ids: list[int], vocab_size: int, max_model_len: int) -> None:
    """The engine's one prompt check (the scheduler and Request never see a bad prompt)."""
    if not prompt_token_ids:
        raise ValueError("the prompt is empty: it must contain at least one token")
    if len(prompt_token_ids) > max_model_len:
        raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens, more than "
                         f"max_model_len ({max_model_len})")
    bad = [t for t in prompt_token_ids if not is_integer(t) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must be integers in [0, {vocab_size}); got {bad[:5]}")


def checked_params(params: SamplingParams, hints: SchedulingHints, vocab_size: int) -> SamplingParams:
    """The request's own copy of `params`, built (so checked) again: the caller may have changed
    its object since making it, and may change it while the request runs; the request must see
    neither. Token ids it names must be in the vocabulary."""
    if not isinstance(hints, SchedulingHints):
        raise ValueError(f"hints must be SchedulingHints, got {type(hints).__name__}")
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
    params = dataclasses.replace(params)
    if any(t >= vocab_size for t in params.stop_token_ids):
        raise ParameterError("stop_token_ids", "stop_token_ids must be token ids below the vocabulary size "
                             f"({vocab_size}), got {params.stop_token_ids}")
    if params.logit_bias and any(t >= vocab_size for t in params.logit_bias):
        raise ParameterError("logit_bias", f"logit_bias must name token ids below the vocabulary size ({vocab_size}), "
                             f"got {sorted(t for t in params.logit_bias if t >= vocab_size)[:5]}")
    return params


def check_resume(resume: Optional[ResumeState], params: SamplingParams, vocab_size: int) -> None:
    """Restored outputs (failover) must be what the request could have produced."""
    if resume is None:
        return
    if not isinstance(resume, ResumeState):
        raise ValueError(f"resume must be a ResumeState, got {type(resume).__name__}")
    bad = [t for t in resume.output_token_ids if not is_integer(t) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"restored output token ids must be integers in [0, {vocab_size}); got {bad[:5]}")
    if params.logprobs is not None and len(resume.logprobs or ()) != len(resume.output_token_ids):
        raise ValueError(f"a request with logprobs resumes with one logprobs entry per restored token: "
                         f"{len(resume.output_token_ids)} tokens, {len(resume.logprobs or ())} entries")

"""OpenAI request bodies (pydantic) and their translation into SamplingParams.

Only types are checked here; value ranges are SamplingParams' job (its ValueErrors name the
field), so one set of rules serves the offline API and the server. Unknown fields are ignored,
as OpenAI-compatible servers do, so clients that send extras (`user`, ...) keep working.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from tokenweir.request import SamplingParams, SchedulingHints

Number = Union[StrictInt, StrictFloat]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class GenerationRequest(BaseModel):
    """Fields shared by completions and chat completions, including tokenweir's extras."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[StrictStr] = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    top_k: Optional[StrictInt] = None
    min_p: Optional[Number] = None
    seed: Optional[StrictInt] = None
    stop: Union[None, StrictStr, list[StrictStr]] = None
    stop_token_ids: Optional[list[StrictInt]] = None
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = 0
    include_stop_str_in_output: StrictBool = False
    skip_special_tokens: StrictBool = True
    # Scheduling extras (DESIGN.md "Public API"): carried onto the engine's Request.
    priority: StrictInt = 0
    tenant: Optional[StrictStr] = None
    deadline_ms: Optional[Number] = Field(default=None, gt=0)
    ttft_slo_ms: Optional[Number] = Field(default=None, gt=0)
    tpot_slo_ms: Optional[Number] = Field(default=None, gt=0)
    # vLLM's field: requests with different salts never share prefix-cache blocks.
    cache_salt: Optional[StrictStr] = None

    def sampling_params(self, max_tokens: int, logprobs: Optional[int]) -> SamplingParams:
        """Raises ValueError (from SamplingParams' checks) for values out of range."""
        return SamplingParams(
            max_tokens=max_tokens, min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            seed=self.seed, logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens, n=self.n)

    def scheduling_hints(self, arrival_time: float) -> SchedulingHints:
        """The request's scheduling hints (times in seconds). Raises ValueError out of range."""
        def seconds(ms: Optional[float]) -> Optional[float]:
            return None if ms is None else ms / 1000.0

        return SchedulingHints(priority=self.priority, tenant=self.tenant, arrival_time=arrival_time,
                               deadline=seconds(self.deadline_ms), ttft_slo=seconds(self.ttft_slo_ms),
                               tpot_slo=seconds(self.tpot_slo_ms), cache_salt=self.cache_salt)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(GenerationRequest):
    # One prompt per request: a string or token ids, optionally wrapped in a one-item list.
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]
    max_tokens: Optional[StrictInt] = 16  # OpenAI's default for completions
    logprobs: Optional[StrictInt] = None
    echo: StrictBool = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... reach the template

    role: StrictStr
    content: Union[None, StrictStr, list[TextPart]] = None

    def for_template(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        elif self.content is None:
            message["content"] = ""
        return message


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[StrictInt] = None
    max_completion_tokens: Optional[StrictInt] = None
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = None

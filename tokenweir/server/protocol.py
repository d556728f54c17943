"""OpenAI request and response bodies (pydantic): the API contract the OpenAPI document shows.

Request fields carry the ranges the engine enforces (the limits are imported from
`tokenweir.request`, where SamplingParams and SchedulingHints check them), so the schema admits
only what the server accepts, as far as JSON Schema can say it; what depends on the model or on
the tokenized prompt (lengths, token ids) is checked after tokenizing, and answered with a 400.
Unknown fields are ignored, as OpenAI-compatible servers do, so clients that send extras
(`user`, ...) keep working; but a known field that would change the output in a way this engine
does not do (`tools`, `response_format`, beam search, ...) is refused unless it asks for nothing, so
no client gets an answer that silently ignored what it asked for. `null` means a field's
default, as in OpenAI's API (its clients send null for an argument given as None).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (AfterValidator, AllowInfNan, BaseModel, ConfigDict, Field, PlainValidator, StrictBool,
                      StrictFloat, StrictInt, StrictStr, ValidationError, ValidationInfo, field_validator)
from pydantic_core import PydanticCustomError

from tokenweir.request import (MAX_KEY_CHARS, MAX_LOGIT_BIAS_ENTRIES, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS,
                               MAX_STOP_TOKEN_IDS, PRIORITY_MAX, PRIORITY_MIN, REPETITION_PENALTY_RANGE)

# JSON has no infinity, but Python's parser reads `Infinity` and `NaN`: refuse them here.
Number = Union[StrictInt, Annotated[StrictFloat, AllowInfNan(False)]]
MAX_LOGPROBS = 20  # as SamplingParams and OpenAI
MAX_CONTENT_PARTS = 4096  # text parts in one chat message
Key = Annotated[StrictStr, Field(min_length=1, max_length=MAX_KEY_CHARS)]
StopString = Annotated[StrictStr, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
TokenId = Annotated[StrictInt, Field(ge=0)]
Milliseconds = Optional[Annotated[Number, Field(gt=0)]]
NonEmptyText = Annotated[StrictStr, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


def _null_is(default: Any) -> AfterValidator:
    """null means `default` (the field's type is Optional so the schema admits it)."""
    return AfterValidator(lambda value: default if value is None else value)


def _only(*accepted: Any) -> AfterValidator:
    """A field this engine cannot honour: refused unless null or one of `accepted` (the values
    that ask for nothing: a penalty of 0, an empty `logit_bias`)."""
    allowed = _accepted(accepted)

    def check(value: Any) -> Any:
        if value is not None and value not in accepted:
            raise ValueError(f"not supported (only {allowed})")
        return value
    return AfterValidator(check)


def _accepted(values: tuple[Any, ...]) -> str:
    return " or ".join([*(json.dumps(v) for v in values), "null"])


def _unsupported(*accepted: Any) -> Any:
    """The default of an `_only` field, with what it accepts in the schema's description."""
    return Field(default=None, description=f"not supported: only {_accepted(accepted)}",
                 json_schema_extra={"enum": [*accepted, None]})


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
    n: Annotated[Optional[Annotated[StrictInt, Field(ge=1, le=1)]], _null_is(1),
                 Field(description="parallel sampling is not supported")] = 1
    stream: Annotated[Optional[StrictBool], _null_is(False)] = False
    stream_options: Optional[StreamOptions] = None
    temperature: Optional[Annotated[Number, Field(ge=0)]] = None
    top_p: Optional[Annotated[Number, Field(gt=0, le=1)]] = None
    top_k: Optional[Annotated[StrictInt, Field(ge=-1, lt=2**63)]] = None
    min_p: Optional[Annotated[Number, Field(ge=0, le=1)]] = None
    seed: Optional[Annotated[StrictInt, Field(ge=-(2**63), lt=2**64)]] = None
    stop: Union[None, StopString, Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]] = None
    stop_token_ids: Optional[Annotated[list[Annotated[StrictInt, Field(ge=0, lt=2**63)]],
                                       Field(max_length=MAX_STOP_TOKEN_IDS)]] = None
    ignore_eos: Annotated[Optional[StrictBool], _null_is(False)] = False
    min_tokens: Annotated[Optional[Annotated[StrictInt, Field(ge=0)]], _null_is(0)] = 0
    include_stop_str_in_output: Annotated[Optional[StrictBool], _null_is(False)] = False
    skip_special_tokens: Annotated[Optional[StrictBool], _null_is(True)] = True
    # OpenAI's: {token id as a decimal string: bias}.
    logit_bias: Optional[Annotated[dict[Annotated[StrictStr, Field(pattern=r"^[0-9]{1,18}$")],
                                        Annotated[Number, Field(ge=-100, le=100)]],
                                   Field(max_length=MAX_LOGIT_BIAS_ENTRIES)]] = None
    presence_penalty: Optional[Annotated[Number, Field(ge=-2, le=2)]] = None
    frequency_penalty: Optional[Annotated[Number, Field(ge=-2, le=2)]] = None
    repetition_penalty: Optional[Annotated[Number, Field(ge=REPETITION_PENALTY_RANGE[0],
                                                         le=REPETITION_PENALTY_RANGE[1])]] = None  # vLLM's
    # Asked for nothing unless given: no constrained decoding.
    response_format: Annotated[Optional[dict[StrictStr, Any]], _only({"type": "text"})] = _unsupported({"type": "text"})
    # vLLM's extras that change what is computed or returned.
    use_beam_search: Annotated[Optional[StrictBool], _only(False)] = _unsupported(False)
    prompt_logprobs: Annotated[Optional[StrictInt], _only()] = _unsupported()
    truncate_prompt_tokens: Annotated[Optional[StrictInt], _only()] = _unsupported()
    guided_json: Annotated[Optional[Any], _only()] = _unsupported()
    guided_regex: Annotated[Optional[Any], _only()] = _unsupported()
    guided_choice: Annotated[Optional[Any], _only()] = _unsupported()
    guided_grammar: Annotated[Optional[Any], _only()] = _unsupported()
    # Scheduling extras (DESIGN.md "Public API"), carried onto the engine's Request as
    # SchedulingHints. Smaller priority values are served first (vLLM's sense).
    priority: Annotated[Optional[Annotated[StrictInt, Field(ge=PRIORITY_MIN, le=PRIORITY_MAX)]], _null_is(0)] = 0
    tenant: Optional[Key] = None
    deadline_ms: Milliseconds = None
    ttft_slo_ms: Milliseconds = None
    tpot_slo_ms: Milliseconds = None
    cache_salt: Optional[Key] = Field(
        default=None, description="requests with different salts never share prefix-cache blocks: "
                                  "give each tenant its own salt to isolate their caches")

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value: Optional[StreamOptions], info: ValidationInfo) -> Optional[StreamOptions]:
        if value is not None and not info.data.get("stream"):
            raise ValueError("only allowed with stream: true")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


_PromptShapes = Union[NonEmptyText, TokenIds,
                     Annotated[list[NonEmptyText], Field(min_length=1)],
                     Annotated[list[TokenIds], Field(min_length=1)]]


def _is_token_id(value: Any) -> bool:
    return type(value) is int and value >= 0  # not a bool, as StrictInt


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(map(_is_token_id, value))


def _check_prompt(value: Any) -> Union[str, list]:
    """One of the four prompt shapes, checked in one pass with one error. pydantic's union
    reports an error per element for every list shape an input fails, on the event loop: a
    4 MiB list of ids ending in a string took a minute, the whole server waiting."""
    if isinstance(value, str):
        if not value:
            raise ValueError("the prompt must not be empty")
        return value
    if not isinstance(value, list) or not value:
        raise ValueError("the prompt must be a non-empty string, a non-empty list of token ids, or a list of either")
    first = value[0]
    if isinstance(first, str):
        fits, shape = (lambda x: isinstance(x, str) and bool(x)), "a non-empty string"
    elif isinstance(first, list):
        fits, shape = _is_token_ids, "a non-empty list of token ids"
    else:
        fits, shape = _is_token_id, "a token id (an integer >= 0)"
    bad = next((i for i, item in enumerate(value) if not fits(item)), None)
    if bad is not None:
        like = " like prompt[0]" if bad else ""
        raise ValueError(f"prompt[{bad}] must be {shape}{like}, got {value[bad]!r:.80}")
    return value


Prompt = Annotated[Union[str, list], PlainValidator(_check_prompt, json_schema_input_type=_PromptShapes)]


class CompletionRequest(GenerationRequest):
    # One prompt per request: a string or token ids, optionally wrapped in a one-item list.
    prompt: Prompt
    max_tokens: Optional[Annotated[StrictInt, Field(ge=1)]] = 16  # OpenAI's default for completions
    logprobs: Optional[Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)]] = None
    echo: Annotated[Optional[StrictBool], _only(False)] = _unsupported(False)
    best_of: Annotated[Optional[StrictInt], _only(1)] = _unsupported(1)
    suffix: Annotated[Optional[StrictStr], _only("")] = _unsupported("")


class TextPart(BaseModel):
    type: Literal["text"]
    text: StrictStr


# The roles SmolLM2's ChatML template (and OpenAI) know; any other string would be rendered raw
# into the template, where the model has never seen it.
Role = Literal["system", "user", "assistant", "tool"]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... reach the template

    role: Role
    # Bounded so that a list of bad parts is one error (checked before its items), not one per part.
    content: Union[None, StrictStr, Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)]] = None

    def for_template(self) -> dict[str, Any]:
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        elif self.content is None:
            message["content"] = ""
        return message


# `top_logprobs` needs `logprobs: true`: a rule across two fields, which the server checks
# (translate.py) and the schema states as "top_logprobs is null/absent, or logprobs is true".
_TOP_LOGPROBS_NEED_LOGPROBS = {"anyOf": [
    {"properties": {"top_logprobs": {"type": "null"}}},
    {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
]}


def _check_messages(value: Any) -> list[ChatMessage]:
    """Message by message, stopping at the first bad one with its first error: pydantic would
    report every error of every message (a 1 MiB list of bad messages was 800,000 errors and
    4 s of the event loop)."""
    if not isinstance(value, list) or not value:
        raise ValueError("messages must be a non-empty list of messages")
    messages = []
    for i, item in enumerate(value):
        try:
            messages.append(ChatMessage.model_validate(item))
        except ValidationError as e:
            # The most specific error: a bad content part rather than "content is not a string".
            error = sorted(e.errors(include_url=False), key=lambda err: len(err["loc"]))[-1]
            where = "".join(f".{part}" for part in error["loc"]
                            if not (isinstance(part, str) and (part == "str" or "[" in part)))  # union tags
            # The error's `param` is this path (errors.validation_error reads it from ctx).
            raise PydanticCustomError("invalid_message", "{detail}",
                                      {"param": f"messages.{i}{where}", "detail": error["msg"]}) from None
    return messages


Messages = Annotated[list[ChatMessage], PlainValidator(
    _check_messages, json_schema_input_type=Annotated[list[ChatMessage], Field(min_length=1)])]


class ChatCompletionRequest(GenerationRequest):
    model_config = ConfigDict(extra="ignore", json_schema_extra=_TOP_LOGPROBS_NEED_LOGPROBS)

    messages: Messages
    max_tokens: Optional[Annotated[StrictInt, Field(ge=1)]] = None
    max_completion_tokens: Optional[Annotated[StrictInt, Field(ge=1)]] = None
    logprobs: Annotated[Optional[StrictBool], _null_is(False)] = False
    top_logprobs: Optional[Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)]] = None
    # No tool or function calling: a request may say "none" or "auto" with no tools.
    tools: Annotated[Optional[list[Any]], _only([])] = _unsupported([])
    tool_choice: Annotated[Optional[Union[StrictStr, dict[StrictStr, Any]]], _only("none", "auto")] = _unsupported("none", "auto")
    functions: Annotated[Optional[list[Any]], _only([])] = _unsupported([])
    function_call: Annotated[Optional[Union[StrictStr, dict[StrictStr, Any]]], _only("none", "auto")] = _unsupported("none", "auto")


# ---------------------------------------------------------------- responses (as documented)

FinishReason = Optional[Literal["stop", "length", "abort"]]
StopReason = Union[None, int, str]  # the stop token id or stop string that ended the request


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs]
    finish_reason: FinishReason
    stop_reason: StopReason


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs]
    finish_reason: FinishReason
    stop_reason: StopReason


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class HealthResponse(BaseModel):
    status: Literal["ok"]


class VersionResponse(BaseModel):
    version: str

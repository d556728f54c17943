"""From token ids to what users read: incremental detokenization, stop strings, RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Optional, Union

from tokenweir.request import FinishReason, Request, RequestStatus, ResumeState

if TYPE_CHECKING:
    from tokenweir.model.runner import Logprobs

# Prompt tokens decoded together with the first output tokens, so that a tokenizer which
# renders a leading space depending on the previous token (SentencePiece, byte-level BPE)
# produces the same text as decoding the whole sequence.
_CONTEXT_TOKENS = 5


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float]
    first_token_time: Optional[float]
    finished_time: Optional[float]
    num_preemptions: int
    num_cached_tokens: int


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort"
    stop_reason: Union[None, int, str] = None  # the stop string or stop token id that matched
    logprobs: Optional[list[dict[int, float]]] = None  # per token: {token id: logprob}, sampled first
    cumulative_logprob: Optional[float] = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # Why the engine ended it when no stop condition did (the scheduler shed it: "deadline
    # exceeded: ..."; finish_reason "abort"); None otherwise, a user's abort included.
    status_message: Optional[str] = None


@dataclass
class OutputState:
    """Per-request text state. `text` is everything decoded so far; `num_emitted_chars` how much
    of it may be shown (the rest could still turn out to be the start of a stop string)."""

    request: Request
    prompt: Optional[str]
    prefix_offset: int
    read_offset: int
    text: str = ""
    num_emitted_chars: int = 0
    logprobs: Optional[list[dict[int, float]]] = None
    cumulative_logprob: float = 0.0
    stop_reason: Union[None, int, str] = None
    stopped_by_string: bool = False


@dataclass
class ProcessedTokens:
    """What a step's detokenization decided, for the engine to apply to the scheduler."""

    finished: dict[str, RequestStatus] = field(default_factory=dict)  # a stop string matched
    failed: dict[str, Exception] = field(default_factory=dict)  # processing this request raised


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def new_state(self, request: Request, prompt: Optional[str]) -> OutputState:
        n = request.num_prompt_tokens
        state = OutputState(request, prompt, prefix_offset=max(0, n - _CONTEXT_TOKENS), read_offset=n)
        if request.sampling_params.logprobs is not None:
            state.logprobs = []
        return state

    def _decode(self, token_ids: list[int], skip_special: bool) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special)

    def process_step(self, items: Iterable[tuple[OutputState, int, Optional[Logprobs]]]) -> ProcessedTokens:
        """Process each (state, number of new tokens, logprobs) of a step. A request whose
        processing raises is reported as failed; the others go on."""
        result = ProcessedTokens()
        for state, num_new_tokens, logprobs in items:
            rid = state.request.request_id
            try:
                if self.process_tokens(state, num_new_tokens, logprobs):
                    result.finished[rid] = RequestStatus.FINISHED_STOPPED
            except Exception as e:  # one request's output failing must not fail the others
                result.failed[rid] = e
        return result

    def process_tokens(self, state: OutputState, num_new_tokens: int,
                       logprobs: Optional[Logprobs] = None) -> bool:
        """Append the request's newest tokens to its text. Returns True if a stop string
        matched (the text is then cut there and the caller must finish the request)."""
        request = state.request
        params = request.sampling_params
        if logprobs is not None and state.logprobs is not None:
            sampled_lp, top = logprobs
            token = request.output_token_ids[-1]
            entry = {token: sampled_lp}
            entry.update((t, lp) for t, lp in top if t not in entry)
            state.logprobs.append(entry)
            state.cumulative_logprob += sampled_lp
        if num_new_tokens == 0:
            return False
        all_ids = request.all_token_ids
        new_text = self._new_text(state, all_ids, len(all_ids), request.is_finished)
        if not new_text:
            return False
        old_len = len(state.text)
        state.text += new_text
        # As vLLM does, stop strings only count past min_tokens, like EOS and stop ids.
        if params.stop and request.num_output_tokens > params.min_tokens:
            match = self._first_stop(state.text, old_len, params.stop)
            if match is not None:
                idx, stop = match
                end = idx + len(stop) if params.include_stop_str_in_output else idx
                state.text = state.text[:end]
                state.stop_reason = stop
                state.stopped_by_string = True
                return True
        return False

    def _new_text(self, state: OutputState, all_ids: list[int], end: int, finished: bool) -> str:
        """The text the tokens of `all_ids` up to `end` add, moving the state's decode window past them."""
        skip = state.request.sampling_params.skip_special_tokens
        # Decode a sliding window and keep only text past the part decoded before; hold back
        # text ending in U+FFFD, an incomplete UTF-8 sequence whose next byte is in the next token.
        prefix_text = self._decode(all_ids[state.prefix_offset:state.read_offset], skip)
        full_text = self._decode(all_ids[state.prefix_offset:end], skip)
        if len(full_text) <= len(prefix_text):
            return ""
        if not full_text.endswith("\ufffd"):
            state.prefix_offset, state.read_offset = state.read_offset, end
        elif not finished:
            return ""
        # (A finished stream flushes an incomplete character as it is.)
        return full_text[len(prefix_text):]

    def restore_state(self, state: OutputState, resume: ResumeState) -> None:
        """A request resumed from another engine's outputs (`Request.restore`): its text
        rebuilt as that engine's steps built it, one token a step (a decode step samples one),
        so the text, what is held back for stop strings and the decode window are that engine's;
        its logprobs as the client received them."""
        all_ids = state.request.all_token_ids
        for end in range(state.request.num_prompt_tokens + 1, len(all_ids) + 1):
            state.text += self._new_text(state, all_ids, end, finished=False)
        if state.logprobs is not None:
            state.logprobs = list(resume.logprobs or ())
            state.cumulative_logprob = resume.cumulative_logprob

    @staticmethod
    def _first_stop(text: str, old_len: int, stops: list[str]) -> Optional[tuple[int, str]]:
        """The stop string that the new text (past `old_len`) completes first, read character
        by character: the match that ends earliest, and of those the one that starts earliest
        (the longest), so the cut text holds none of the stop strings. Each stop is searched
        from where a match of its own length could reach the new text: a common start (that of
        the longest stop) would find a shorter stop inside text written while min_tokens held
        the search back. vLLM takes the first stop in list order instead, which can leave an
        earlier-ending stop string in the text when one token completes two."""
        best: Optional[tuple[int, int, str]] = None  # (end, start, stop)
        for stop in stops:
            idx = text.find(stop, max(0, old_len - len(stop) + 1))
            if idx != -1 and (best is None or (idx + len(stop), idx) < best[:2]):
                best = (idx + len(stop), idx, stop)
        return None if best is None else (best[1], best[2])

    def emittable_text(self, state: OutputState) -> str:
        """Text safe to show now: while running, hold back the last len(longest stop) - 1
        characters, which could be the beginning of a stop string."""
        stops = state.request.sampling_params.stop
        if state.request.is_finished or not stops:
            return state.text
        hold = max(len(s) for s in stops) - 1
        return state.text[:max(state.num_emitted_chars, len(state.text) - hold)]

    def make_output(self, state: OutputState) -> RequestOutput:
        request = state.request
        text = self.emittable_text(state)
        state.num_emitted_chars = len(text)
        # A stop string ends the text even when the same token also reached max_tokens and the
        # scheduler finished the request by length first (vLLM reports "stop" too).
        finish_reason = FinishReason.STOP if state.stopped_by_string else request.finish_reason
        stop_reason = state.stop_reason if state.stopped_by_string else request.stop_reason
        completion = CompletionOutput(
            index=0, text=text, token_ids=list(request.output_token_ids),
            finish_reason=str(finish_reason) if finish_reason is not None else None,
            # Copies: the engine appends to its lists while the caller holds this output.
            stop_reason=stop_reason, logprobs=None if state.logprobs is None else list(state.logprobs),
            cumulative_logprob=state.cumulative_logprob if state.logprobs is not None else None)
        metrics = RequestMetrics(
            arrival_time=request.arrival_time, first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time, finished_time=request.finished_time,
            num_preemptions=request.num_preemptions, num_cached_tokens=max(0, request.num_cached_tokens))
        return RequestOutput(request_id=request.request_id, prompt=state.prompt,
                             prompt_token_ids=list(request.prompt_token_ids), outputs=[completion],
                             finished=request.is_finished, metrics=metrics, status_message=request.status_message)

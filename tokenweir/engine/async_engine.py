"""AsyncLLMEngine: the asyncio front of EngineCore, for the server.

EngineCore is single-threaded and its steps block (the model runs for milliseconds to seconds),
so it lives in one background thread that owns it exclusively, running the engine loop
(engine/core_loop.py). The event loop never touches it: it sends commands (add, abort) through a
thread-safe queue, and the engine thread reports back to this front (the loop's sink), which
counts the metrics and hands each request's outputs to its stream with
`loop.call_soon_threadsafe`. `tokenweir serve` runs the same loop in a process of its own
instead (engine/core_process.py, a subclass of this front), so that the model's threads never
wait on the event loop's interpreter lock.

Failures stay as small as they can be: a bad prompt fails its `add_request` (ValueError), an
error in one request's output processing fails that request's stream, an exception in a step
fails the requests that step scheduled (EngineCore's StepResult names them) and every other
request goes on. Only an error in the loop itself (or in the scheduler's `schedule()`, after
which its state is unknown) kills the engine, and then every stream and every later call says so.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Iterable, Optional, Union

from prometheus_client import CollectorRegistry

from tokenweir.config import EngineArgs
from tokenweir.core.scheduler import SchedulerStats
from tokenweir.engine.client import DeadlineExceededError, EngineDeadError, ModelInfo
from tokenweir.engine.core import EngineCore
from tokenweir.engine.core_loop import AbortCommand, AddCommand, Command, CoreLoop, ShutdownCommand, take_commands
from tokenweir.engine.output import RequestOutput
from tokenweir.engine.step_trace import StepTrace
from tokenweir.metrics import EngineMetrics, StatsLogger
from tokenweir.request import SamplingParams, SchedulingHints

logger = logging.getLogger("tokenweir")

STATS_LOG_INTERVAL_S = 5.0


class RequestStream:
    """One request's outputs, handed from the engine thread to the event loop.

    The engine-thread methods (`put_*`) only schedule the loop-side ones, so all state changes
    happen on the loop and need no lock. Outputs are cumulative, so only the newest is kept: a
    consumer slower than the engine reads merged progress instead of a growing backlog.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop,
                 on_done: Callable[[RequestStream], None]) -> None:
        self.request_id = request_id
        self._loop = loop
        self._on_done = on_done
        self.accepted: asyncio.Future[None] = loop.create_future()
        self._latest: Optional[RequestOutput] = None
        self._error: Optional[BaseException] = None
        self._ready = asyncio.Event()
        self.done = False  # the final output or an error has arrived
        self.consumed = False  # ... and the consumer has read it

    # ---------------------------------------------------------------- engine thread

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more

    def put_accepted(self, error: Optional[BaseException]) -> None:
        self._post(self._set_accepted, error)

    def put_output(self, output: RequestOutput) -> None:
        self._post(self._set_output, output)

    def put_error(self, error: BaseException) -> None:
        self._post(self._set_error, error)

    # ---------------------------------------------------------------- event loop

    def _set_accepted(self, error: Optional[BaseException]) -> None:
        if error is not None:
            self._finish()  # rejected: there will be no outputs
        if self.accepted.done():
            return  # the caller stopped waiting (cancelled)
        if error is None:
            self.accepted.set_result(None)
        else:
            self.accepted.set_exception(error)

    def _set_output(self, output: RequestOutput) -> None:
        self._latest = output
        self._ready.set()
        if output.finished:
            self._finish()

    def _set_error(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()
        if not self.accepted.done():
            self.accepted.set_exception(error)
        self._finish()

    def _finish(self) -> None:
        if not self.done:
            self.done = True
            self._on_done(self)

    async def get(self) -> RequestOutput:
        """The newest output; raises the request's error once the outputs before it are read."""
        while self._latest is None and self._error is None:
            await self._ready.wait()
            self._ready.clear()
        output, self._latest = self._latest, None
        if output is not None:
            self.consumed = output.finished
            return output
        self.consumed = True
        assert self._error is not None
        raise self._error


class RequestOutputs:
    """One request's cumulative outputs, as `add_request` returns them: an async iterator that
    ends after the final output, and whose `aclose()` aborts the request if that output has
    not been read. (An async generator's `aclose()` does nothing before its first iteration,
    so a caller that gave up between the ack and the first output would leave the request
    running.)"""

    def __init__(self, stream: RequestStream, on_close: Callable[[RequestStream], None]) -> None:
        self._stream = stream
        self._on_close = on_close
        self._closed = False

    def __aiter__(self) -> RequestOutputs:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._closed or self._stream.consumed:
            raise StopAsyncIteration
        try:
            return await self._stream.get()
        except BaseException:
            await self.aclose()  # an error or a cancelled reader: the request ends here either way
            raise

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._on_close(self._stream)

    def __del__(self) -> None:
        # Dropped unclosed (as an abandoned async generator would be finalized): close on the
        # stream's loop, since the collector may run in any thread.
        if not self._closed:
            self._closed = True
            self._stream._post(self._on_close, self._stream)


@dataclass
class _Progress:
    """Engine-thread bookkeeping of what a request has produced, for the token metrics."""

    hints: SchedulingHints = SchedulingHints()  # for the per-class / per-tenant metrics
    num_tokens: int = 0
    last_output_time: float = 0.0


@dataclass
class _EngineSide:
    """State only the thread that runs the sink (the engine thread) touches."""

    streams: dict[str, RequestStream] = field(default_factory=dict)
    progress: dict[str, _Progress] = field(default_factory=dict)


class AsyncLLMEngine:
    """The asyncio front of one in-process EngineCore; implements `EngineClient`."""

    def __init__(self, core: EngineCore, *, log_stats: Optional[bool] = None,
                 stats_interval_s: float = STATS_LOG_INTERVAL_S,
                 step_trace: Optional[StepTrace] = None) -> None:
        self.core = core
        self._step_trace = step_trace  # used by the engine thread only
        # The server tokenizes in its threads while the engine thread detokenizes. A copy of
        # its own keeps the engine thread off the server's Rust tokenizer, whose mutating calls
        # (padding and truncation settings) fail when another thread holds it.
        self._init_front(ModelInfo(core.served_model_name, core.max_model_len, core.loaded.arch.vocab_size,
                                   core.default_sampling_params),
                         copy.deepcopy(core.tokenizer), core.args, core.scheduler_config.max_num_batched_tokens,
                         core.get_stats(), log_stats, stats_interval_s, core.clock)
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="tokenweir-engine", daemon=True)
        self._thread.start()

    def _init_front(self, model_info: ModelInfo, tokenizer: Any, args: EngineArgs, max_num_batched_tokens: int,
                    stats: SchedulerStats, log_stats: Optional[bool], stats_interval_s: float,
                    clock: Callable[[], float]) -> None:
        """The state of the front, wherever the engine loop runs."""
        self.model_info = model_info
        self.tokenizer = tokenizer
        self._clock = clock  # the engine's: one clock for the scheduler's times and the token metrics
        self.metrics = EngineMetrics(model_info.name, max_num_batched_tokens, model_info.max_model_len,
                                     num_priority_classes=args.num_priority_classes)
        log_stats = not args.disable_log_stats if log_stats is None else log_stats
        self._stats_logger = StatsLogger(stats_interval_s, self._clock()) if log_stats else None
        self._idle_wait_s = stats_interval_s if log_stats else None
        self._side = _EngineSide()
        # Held while checking for death and submitting, and while dying, so that no request is
        # submitted after the streams have been failed.
        self._submit_lock = threading.Lock()
        self._dead: Optional[BaseException] = None
        # Loop side: requests with a live stream, and adds the engine has not acknowledged yet.
        self._active: dict[str, RequestStream] = {}
        # Adds handed to the engine, counted by the loop; the engine's side counts those it has
        # taken (see `_published`).
        self._num_submitted = 0
        # Adds submitted and not yet acknowledged: set by the event loop under the submit lock,
        # taken by the sink's thread on the ack (or failed when the engine dies).
        self._pending: dict[str, tuple[RequestStream, SchedulingHints]] = {}
        # Published by the sink after each command batch and step, and once each step has
        # scheduled, as one tuple (one reference store, read whole by the loop): the adds the
        # engine has taken so far (accepted or refused) and its waiting count, which counts the
        # accepted ones among them. Two separate stores would let the loop read a request twice
        # (in the waiting count and still in transit) or not at all, and the server's waiting
        # limit refuse one request too many or admit one too many.
        self._num_taken = 0  # the sink's own running count, published with the waiting count
        self._published: tuple[int, int] = (0, 0)
        self._num_unfinished = 0
        self._stats = stats
        # Liveness (`stalled_seconds`), on the wall's monotonic clock (the engine's may be
        # virtual): when the engine loop last reported (a step done, or its stats after a batch
        # of commands, or after an idle wait when stats are logged: the sink's thread), and
        # when work reached an engine that had none (the event loop's, under the submit lock).
        self._heard_at = time.monotonic()
        self._transit_since = self._heard_at

    @classmethod
    def from_engine_args(cls, args: EngineArgs, step_trace: Optional[StepTrace] = None) -> AsyncLLMEngine:
        return cls(EngineCore(args), step_trace=step_trace)

    # ================================================================ event-loop API

    @property
    def is_running(self) -> bool:
        return self._dead is None

    @property
    def dead_error(self) -> Optional[BaseException]:
        return self._dead

    @property
    def metrics_registry(self) -> CollectorRegistry:
        return self.metrics.registry

    def reserve_tenant_labels(self, tenants: Iterable[str]) -> None:
        self.metrics.classes.tenant_label.reserve(tenants)

    def get_stats(self) -> SchedulerStats:
        """The scheduler's stats as of the engine thread's last publication."""
        return self._stats

    def num_waiting_requests(self) -> int:
        """Requests not running yet: waiting in the scheduler or still on their way to it."""
        num_taken, num_waiting = self._published
        return num_waiting + self._num_submitted - num_taken

    def stalled_seconds(self) -> Optional[float]:
        """Seconds the engine loop has gone without reporting while it has work (requests it
        holds, or adds on their way to it): since its last report, or since the adds in transit
        began if that is later. None while it has none: an idle loop may wait for commands
        indefinitely. A step that really takes this long reads the same: from outside it
        cannot be told from a hung one."""
        if self._engine_idle():
            return None
        return max(0.0, time.monotonic() - max(self._heard_at, self._transit_since))

    def _engine_idle(self) -> bool:
        """The engine holds no request and none is on its way to it, as far as it has said."""
        return self._num_unfinished == 0 and self._num_submitted == self._published[0]

    def num_unfinished_requests(self) -> int:
        """Requests the engine holds or that still have a live stream. The engine's count comes
        with its stats, after the acks of the adds it took: a request accepted and closed at once
        (its stream forgotten) is counted until then by the engine side's streams, which keep it
        until its final output is counted in the metrics (a length read from this thread)."""
        return max(self._num_unfinished, len(self._active), len(self._side.streams))

    async def add_request(self, request_id: str, prompt: Union[str, list[int]], params: SamplingParams,
                          hints: SchedulingHints = SchedulingHints(), *,
                          prompt_text: Optional[str] = None) -> RequestOutputs:
        """Queue a request and wait until the engine has accepted it; returns its outputs.

        Raises ValueError for bad input (EngineCore.add_request's checks) and EngineDeadError
        when the engine no longer runs. Closing the returned outputs before their final one
        (leaving an `async for` over them early, or `aclose()` without reading any) aborts the
        request.
        """
        if request_id in self._active:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = RequestStream(request_id, asyncio.get_running_loop(), self._forget)
        self._submit(AddCommand(request_id, prompt, params, hints, prompt_text), pending=(stream, hints))
        self._active[request_id] = stream
        try:
            await stream.accepted
        except asyncio.CancelledError:
            self.abort(request_id)  # the caller is gone; the engine may still accept it
            raise
        return RequestOutputs(stream, self._close_stream)

    async def generate(self, request_id: str, prompt: Union[str, list[int]], params: SamplingParams,
                       hints: SchedulingHints = SchedulingHints(), *,
                       prompt_text: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's cumulative outputs (callers compute deltas); see `add_request`."""
        outputs = await self.add_request(request_id, prompt, params, hints, prompt_text=prompt_text)
        try:
            async for output in outputs:
                yield output
        finally:
            await outputs.aclose()  # runs its abort-if-unfinished now, not when collected

    def _close_stream(self, stream: RequestStream) -> None:
        if not stream.consumed:
            self.abort(stream.request_id)
            # Nobody reads this stream any more (its event loop may even be closing): the
            # engine's own count covers the request until the abort has run.
            self._forget(stream)

    def abort(self, request_id: str) -> None:
        """Abort a request (a client went away). Its blocks are freed before the next step;
        its stream ends with an output whose finish_reason is "abort". Unknown or finished
        ids are ignored."""
        stream = self._active.get(request_id)
        if stream is not None and not stream.done:
            self._submit(AbortCommand(request_id), quiet=True)

    def shutdown(self) -> None:
        """Stop the engine thread; requests in flight fail with EngineDeadError."""
        self._submit(ShutdownCommand(), quiet=True)
        self._thread.join()

    def _forget(self, stream: RequestStream) -> None:
        # By identity: a stream closed early is forgotten at once, so its id may already name a
        # new request when the old one's final (aborted) output arrives and forgets it again.
        if self._active.get(stream.request_id) is stream:
            del self._active[stream.request_id]

    def _submit(self, command: Command, quiet: bool = False,
                pending: Optional[tuple[RequestStream, SchedulingHints]] = None) -> None:
        with self._submit_lock:
            if self._dead is not None:
                if quiet:
                    return
                raise EngineDeadError(f"the engine is not running: {self._dead}") from self._dead
            # Work reaching an idle engine starts the stall count; one that holds work already
            # must report on its own (an add to a hung engine must not restart the count).
            idle = self._engine_idle()
            if pending is not None:  # before the command: its ack may come at once
                self._pending[pending[0].request_id] = pending
            try:
                self._send(command)
            except BaseException:
                if pending is not None:
                    self._pending.pop(pending[0].request_id, None)
                raise
            if pending is not None:
                if idle:
                    self._transit_since = time.monotonic()
                self._num_submitted += 1

    def _send(self, command: Command) -> None:
        """Hand a command to the engine loop (called under the submit lock)."""
        self._commands.put(command)

    # ================================================================ engine thread

    def _run(self) -> None:
        loop = CoreLoop(self.core, self, self._step_trace)
        try:
            loop.run(self._next_commands)
            reason: BaseException = EngineDeadError("the engine was shut down")
        except BaseException as e:
            logger.exception("the engine loop died")
            reason = EngineDeadError(f"the engine loop died: {e!r}")
        self._die(reason)
        try:
            loop.release_all()
        except Exception:
            logger.exception("cleaning up the engine after it stopped failed")

    def _next_commands(self, block: bool) -> list[Command]:
        return take_commands(self._commands, block, self._idle_wait_s)

    def _die(self, reason: BaseException) -> None:
        """The engine loop has ended: every request not finished yet fails with `reason`, and
        every later call says so."""
        with self._submit_lock:
            self._dead = reason
            pending, self._pending = self._pending, {}
        for stream, _ in pending.values():
            stream.put_error(reason)
        for stream in self._side.streams.values():
            stream.put_error(reason)
        self._side.streams.clear()
        self._side.progress.clear()

    # ================================================================ the engine loop's sink

    def on_accepted(self, request_id: str, error: Optional[BaseException]) -> None:
        self._num_taken += 1  # published with the waiting count that counts it (core_loop._accept)
        entry = self._pending.pop(request_id, None)
        if entry is None:
            return
        stream, hints = entry
        if error is None:
            self._side.streams[request_id] = stream
            self._side.progress[request_id] = _Progress(hints)
        stream.put_accepted(error)

    def on_output(self, output: RequestOutput, now: float) -> None:
        self._deliver(output, now)

    def on_expired(self, output: RequestOutput, message: str) -> None:
        self._expire(output, message)

    def on_failed(self, request_id: str, error: BaseException) -> None:
        self._fail_stream(request_id, error)

    def on_iteration(self, num_scheduled_tokens: int) -> None:
        self._heard_at = time.monotonic()
        self.metrics.record_iteration(num_scheduled_tokens)

    def on_waiting(self, num_waiting: int) -> None:
        self._published = (self._num_taken, num_waiting)

    def on_stats(self, stats: SchedulerStats, num_unfinished: int) -> None:
        self._heard_at = time.monotonic()
        self._stats = stats
        self.metrics.record_scheduler_stats(stats)
        self._published = (self._num_taken, stats.num_waiting)
        self._num_unfinished = num_unfinished
        if self._stats_logger is not None:
            self._stats_logger.maybe_log(stats, self._clock())

    def _deliver(self, output: RequestOutput, now: float) -> None:
        """Count the output's new tokens and hand it to its stream (metrics first, so that a
        client that has its answer also finds it counted)."""
        side = self._side
        rid = output.request_id
        progress = side.progress.get(rid)
        stream = side.streams.get(rid)
        if progress is None or stream is None:
            return
        num_tokens = len(output.outputs[0].token_ids)
        num_new = num_tokens - progress.num_tokens
        if num_new > 0:
            first = progress.num_tokens == 0
            if first:
                self.metrics.record_first_token(output, progress.hints)
            self.metrics.record_new_tokens(num_new, None if first else now - progress.last_output_time,
                                           progress.hints)
            if self._stats_logger is not None:
                self._stats_logger.add_tokens(len(output.prompt_token_ids) if first else 0, num_new)
            progress.num_tokens, progress.last_output_time = num_tokens, now
        if output.finished:
            self.metrics.record_finished(output, progress.hints)
            del side.streams[rid], side.progress[rid]
        if num_new > 0 or output.finished:
            stream.put_output(output)

    def _expire(self, output: RequestOutput, message: str) -> None:
        """A request the scheduler gave up on (its deadline passed, or cannot be met): counted as finished
        (aborted), and its stream ends with the error that says why."""
        if output.request_id in self._side.streams:
            self.metrics.record_finished(output, self._side.progress[output.request_id].hints)
        self._fail_stream(output.request_id, DeadlineExceededError(message))

    def _fail_stream(self, request_id: str, error: BaseException) -> None:
        """End a request's stream with an error (the engine has already dropped the request)."""
        self._side.progress.pop(request_id, None)
        stream = self._side.streams.pop(request_id, None)
        if stream is not None:
            stream.put_error(error)

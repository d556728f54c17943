"""AsyncLLMEngine: the asyncio front of EngineCore, for the server.

EngineCore is single-threaded and its steps block (the model runs for milliseconds to seconds),
so it lives in one background thread that owns it exclusively. The event loop never touches it:
it sends commands (add, abort) through a thread-safe queue, and the engine thread hands each
request's outputs back with `loop.call_soon_threadsafe`. Between two steps the engine thread
drains every queued command, so an abort frees the request's KV blocks before the next step.

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
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, AsyncIterator, Callable, Optional, Union

from prometheus_client import CollectorRegistry

from tokenweir.config import EngineArgs
from tokenweir.core.cost_model import step_composition
from tokenweir.core.scheduler import SchedulerStats
from tokenweir.engine import serving_threads
from tokenweir.engine.client import DeadlineExceededError, EngineDeadError, ModelInfo, RequestFailedError
from tokenweir.engine.core import EngineCore
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
                 on_done: Callable[[str], None]) -> None:
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
            self._on_done(self.request_id)

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


@dataclass
class _Add:
    stream: RequestStream
    prompt: Union[str, list[int]]
    params: SamplingParams
    hints: SchedulingHints
    prompt_text: Optional[str]


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Shutdown:
    pass


@dataclass
class _Progress:
    """Engine-thread bookkeeping of what a request has produced, for the token metrics."""

    hints: SchedulingHints = SchedulingHints()  # for the per-class / per-tenant metrics
    num_tokens: int = 0
    last_output_time: float = 0.0


@dataclass
class _EngineSide:
    """State only the engine thread touches."""

    streams: dict[str, RequestStream] = field(default_factory=dict)
    progress: dict[str, _Progress] = field(default_factory=dict)


class AsyncLLMEngine:
    """The asyncio front of one in-process EngineCore; implements `EngineClient`."""

    def __init__(self, core: EngineCore, *, log_stats: Optional[bool] = None,
                 stats_interval_s: float = STATS_LOG_INTERVAL_S,
                 step_trace: Optional[StepTrace] = None) -> None:
        self.core = core
        self._step_trace = step_trace  # used by the engine thread only
        self._clock = core.clock  # one clock for the scheduler's times and the token metrics
        self.model_info = ModelInfo(core.served_model_name, core.max_model_len, core.loaded.arch.vocab_size)
        # The server tokenizes in its threads while the engine thread detokenizes. A copy of
        # its own keeps the engine thread off the server's Rust tokenizer, whose mutating calls
        # (padding and truncation settings) fail when another thread holds it.
        self.tokenizer = copy.deepcopy(core.tokenizer)
        self.metrics = EngineMetrics(core.served_model_name, core.scheduler_config.max_num_batched_tokens,
                                     num_priority_classes=core.args.num_priority_classes)
        log_stats = not core.args.disable_log_stats if log_stats is None else log_stats
        self._stats_logger = StatsLogger(stats_interval_s, self._clock()) if log_stats else None
        self._idle_wait_s = stats_interval_s if log_stats else None
        self._side = _EngineSide()
        self._commands: queue.SimpleQueue[Union[_Add, _Abort, _Shutdown]] = queue.SimpleQueue()
        # Held while checking for death and queueing, and while dying and draining the queue,
        # so that no command is queued after the last drain.
        self._submit_lock = threading.Lock()
        self._dead: Optional[BaseException] = None
        # Loop side: requests with a live stream, and adds the engine has not acknowledged yet.
        self._active: dict[str, RequestStream] = {}
        self._num_in_transit = 0
        # Published by the engine thread after each command batch and step (plain int stores),
        # and the waiting count also once each step has scheduled.
        self._num_waiting = 0
        self._num_unfinished = 0
        self._stats = core.get_stats()
        self._thread = threading.Thread(target=self._run, name="tokenweir-engine", daemon=True)
        self._thread.start()

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

    def get_stats(self) -> SchedulerStats:
        """The scheduler's stats as of the engine thread's last publication."""
        return self._stats

    def num_waiting_requests(self) -> int:
        """Requests not running yet: waiting in the scheduler or still on their way to it."""
        return self._num_waiting + self._num_in_transit

    def num_unfinished_requests(self) -> int:
        """Requests the engine holds or that still have a live stream."""
        return max(self._num_unfinished, len(self._active))

    async def add_request(self, request_id: str, prompt: Union[str, list[int]], params: SamplingParams,
                          hints: SchedulingHints = SchedulingHints(), *,
                          prompt_text: Optional[str] = None) -> AsyncGenerator[RequestOutput, None]:
        """Queue a request and wait until the engine has accepted it; returns its outputs.

        Raises ValueError for bad input (EngineCore.add_request's checks) and EngineDeadError
        when the engine no longer runs. Leaving the returned generator before its final output
        aborts the request.
        """
        if request_id in self._active:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = RequestStream(request_id, asyncio.get_running_loop(), self._forget)
        self._submit(_Add(stream, prompt, params, hints, prompt_text))
        self._active[request_id] = stream
        self._num_in_transit += 1
        try:
            await stream.accepted
        except asyncio.CancelledError:
            self.abort(request_id)  # the caller is gone; the engine may still accept it
            raise
        finally:
            self._num_in_transit -= 1
        return self._outputs(stream)

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

    async def _outputs(self, stream: RequestStream) -> AsyncGenerator[RequestOutput, None]:
        try:
            while True:
                output = await stream.get()
                yield output
                if output.finished:
                    return
        finally:
            if not stream.consumed:
                self.abort(stream.request_id)
                # Nobody reads this stream any more (its event loop may even be closing): the
                # engine's own count covers the request until the abort has run.
                self._forget(stream.request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (a client went away). Its blocks are freed before the next step;
        its stream ends with an output whose finish_reason is "abort". Unknown or finished
        ids are ignored."""
        stream = self._active.get(request_id)
        if stream is not None and not stream.done:
            self._submit(_Abort(request_id), quiet=True)

    def shutdown(self) -> None:
        """Stop the engine thread; requests in flight fail with EngineDeadError."""
        self._submit(_Shutdown(), quiet=True)
        self._thread.join()

    def _forget(self, request_id: str) -> None:
        self._active.pop(request_id, None)

    def _submit(self, command: Union[_Add, _Abort, _Shutdown], quiet: bool = False) -> None:
        with self._submit_lock:
            if self._dead is not None:
                if quiet:
                    return
                raise EngineDeadError(f"the engine is not running: {self._dead}") from self._dead
            self._commands.put(command)

    # ================================================================ engine thread

    def _run(self) -> None:
        try:
            self._loop()
            reason: BaseException = EngineDeadError("the engine was shut down")
        except BaseException as e:
            logger.exception("the engine loop died")
            reason = EngineDeadError(f"the engine loop died: {e!r}")
        with self._submit_lock:
            self._dead = reason
            leftover = []
            while True:
                try:
                    leftover.append(self._commands.get_nowait())
                except queue.Empty:
                    break
        for command in leftover:
            if isinstance(command, _Add):
                command.stream.put_error(reason)
        for stream in self._side.streams.values():
            stream.put_error(reason)
        self._side.streams.clear()
        self._side.progress.clear()
        try:
            # Free what the requests held, so a shut-down engine leaves no blocks behind.
            self.core.abort_requests(list(self.core.states))
            self._publish_stats()
        except Exception:
            logger.exception("cleaning up the engine after it stopped failed")

    def _loop(self) -> None:
        while True:
            idle = not self.core.has_unfinished_requests()
            if idle and self._step_trace is not None:
                self._step_trace.went_idle()
            acks, shutdown = self._handle_commands(block=idle)
            # Stats first, acks second: the loop side counts an add as waiting until its ack,
            # so the sum it reads never misses a request.
            self._publish_stats()
            for stream, error in acks:
                stream.put_accepted(error)
            if shutdown:
                return
            if self.core.has_unfinished_requests():
                self._step()
                self._publish_stats()

    def _publish_waiting(self) -> None:
        self._num_waiting = self.core.num_waiting_requests()

    def _handle_commands(self, block: bool) -> tuple[list[tuple[RequestStream, Optional[BaseException]]], bool]:
        """Run every queued command (waiting for one if `block`); returns the add acks and
        whether shutdown was asked for."""
        acks: list[tuple[RequestStream, Optional[BaseException]]] = []
        try:
            command = self._commands.get(timeout=self._idle_wait_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return acks, False
        while True:
            if isinstance(command, _Shutdown):
                return acks, True
            if isinstance(command, _Add):
                acks.append((command.stream, self._add(command)))
            else:
                self._abort(command.request_id)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return acks, False

    def _add(self, command: _Add) -> Optional[BaseException]:
        rid = command.stream.request_id
        try:
            self.core.add_request(rid, command.prompt, command.params, command.hints,
                                  prompt_text=command.prompt_text)
        except Exception as e:  # EngineCore.add_request is atomic: nothing was added
            if not isinstance(e, ValueError):
                logger.exception("adding request %s failed", rid)
                e = RequestFailedError(f"adding the request failed: {e!r}")
            return e
        self._side.streams[rid] = command.stream
        self._side.progress[rid] = _Progress(command.hints)
        return None

    def _abort(self, request_id: str) -> None:
        for output in self.core.abort_requests([request_id]):
            self._deliver(output, self._clock())

    def _step(self) -> None:
        # The step's two phases, called here rather than through `core.step()`: requests a step
        # admits run from its scheduling on, though the model (a long prefill) may take seconds
        # more, so the waiting count the server's limit reads is published in between.
        scheduled = self.core.schedule()
        try:
            if self._step_trace is not None:
                self._step_trace.step_started(step_composition(
                    scheduled, self.core.scheduler.requests, self.core.kv_bytes_per_block))
            self._publish_waiting()
            serving_threads.before_step(scheduled.total_num_scheduled_tokens)
            result = self.core.execute(scheduled)
        except Exception as e:
            logger.exception("engine step failed before the model ran")
            result = self.core.fail_step(scheduled, e)
        self.metrics.record_iteration(result.scheduler_output.total_num_scheduled_tokens)
        now = self._clock()
        for output in result.outputs:
            if output.request_id in result.expired:
                self._expire(output, result.expired[output.request_id])
            else:
                self._deliver(output, now)
        for rid, error in result.failed.items():
            logger.error("request %s failed in the engine: %r", rid, error)
            failed = RequestFailedError(f"the engine failed this request: {error!r}")
            failed.__cause__ = error
            self._fail_stream(rid, failed)

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
        """A request the scheduler gave up on (its deadline passed): counted as finished
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

    def _publish_stats(self) -> None:
        stats = self._stats = self.core.get_stats()
        self.metrics.record_scheduler_stats(stats)
        self._num_waiting = stats.num_waiting
        self._num_unfinished = len(self.core.states)
        if self._stats_logger is not None:
            self._stats_logger.maybe_log(stats, self._clock())

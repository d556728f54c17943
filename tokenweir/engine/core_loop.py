"""The engine loop: commands in, steps run, everything that happened reported to a sink.

One loop serves both places an engine core can run for the server: a thread of the server's
process (AsyncLLMEngine) or a process of its own (engine/core_process.py). The loop owns the
EngineCore; it takes commands (add, abort, shutdown), drains every queued one between two
steps (so an abort frees its blocks before the next step), steps while any request is
unfinished, and reports to an `EngineSink`: which adds were accepted, each output, what failed
or expired, each step's size, and the scheduler's stats. The sink is the server-side front
(streams and metrics) itself, or a proxy that ships the same calls to it from the engine process.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from dataclasses import dataclass
from typing import Optional, Protocol, Union

from tokenweir.core.cost_model import step_composition
from tokenweir.core.scheduler import SchedulerStats
from tokenweir.engine import serving_threads
from tokenweir.engine.client import RequestFailedError
from tokenweir.engine.core import EngineCore
from tokenweir.engine.output import RequestOutput
from tokenweir.engine.step_trace import StepTrace
from tokenweir.request import ResumeState, SamplingParams, SchedulingHints

logger = logging.getLogger("tokenweir")


@dataclass
class AddCommand:
    request_id: str
    prompt: Union[str, list[int]]
    params: SamplingParams
    hints: SchedulingHints
    prompt_text: Optional[str]
    resume: Optional[ResumeState] = None  # failover: what the client already has of it


@dataclass
class AbortCommand:
    request_id: str


@dataclass
class ShutdownCommand:
    pass


Command = Union[AddCommand, AbortCommand, ShutdownCommand]


class EngineSink(Protocol):
    """What the loop reports, in the order it happens."""

    def on_accepted(self, request_id: str, error: Optional[BaseException]) -> None: ...
    def on_output(self, output: RequestOutput, now: float) -> None: ...
    def on_expired(self, output: RequestOutput, message: str) -> None: ...
    def on_failed(self, request_id: str, error: BaseException) -> None: ...
    def on_iteration(self, num_scheduled_tokens: int) -> None: ...
    def on_waiting(self, num_waiting: int) -> None: ...
    def on_stats(self, stats: SchedulerStats, num_unfinished: int) -> None: ...


# Returns the queued commands, waiting for the first one if `block` (up to the idle wait).
CommandSource = Callable[[bool], list[Command]]


def take_commands(commands: queue.SimpleQueue, block: bool, wait_s: Optional[float]) -> list:
    """A CommandSource's work over a thread-safe queue (or any such queue's): everything queued,
    waiting up to `wait_s` (None: for ever) for the first item if `block`."""
    try:
        taken = [commands.get(timeout=wait_s) if block else commands.get_nowait()]
    except queue.Empty:
        return []
    while True:
        try:
            taken.append(commands.get_nowait())
        except queue.Empty:
            return taken


class CoreLoop:
    def __init__(self, core: EngineCore, sink: EngineSink, step_trace: Optional[StepTrace] = None,
                 flush: Callable[[], None] = lambda: None) -> None:
        self.core = core
        self.sink = sink
        self.step_trace = step_trace
        self.flush = flush  # hands what the sink holds on (the engine process sends it)

    def run(self, next_commands: CommandSource) -> None:
        """Until a shutdown command; an exception here is the engine's death (the caller's)."""
        core = self.core
        while True:
            idle = not core.has_unfinished_requests()
            if idle and self.step_trace is not None:
                self.step_trace.went_idle()
            shutdown = self._handle(next_commands(idle))
            self.flush()
            if shutdown:
                return
            if core.has_unfinished_requests():
                self._step()
                self._publish_stats()
                self.flush()

    def release_all(self) -> None:
        """After the loop ended: free what the requests held, so a stopped engine leaves no
        blocks behind."""
        self.core.abort_requests(list(self.core.states))
        self._publish_stats()
        self.flush()

    def _handle(self, commands: list[Command]) -> bool:
        """Run the commands in order; returns whether one was a shutdown."""
        acks: list[tuple[str, Optional[BaseException]]] = []
        shutdown = False
        for command in commands:
            if isinstance(command, ShutdownCommand):
                shutdown = True
                break
            if isinstance(command, AddCommand):
                acks.append((command.request_id, self._add(command)))
                continue
            # An abort may be for a request added in this same batch (its caller gave up while
            # waiting for the ack): the front must know the request before its final output.
            if acks:
                self._accept(acks)
                acks = []
            now = self.core.clock()
            for output in self.core.abort_requests([command.request_id]):
                self.sink.on_output(output, now)
        self._accept(acks)
        return shutdown

    def _accept(self, acks: list[tuple[str, Optional[BaseException]]]) -> None:
        # Acks first, stats second: the front counts an add in transit until the engine's
        # published count of the adds it took covers it, and that count goes out with the
        # waiting count in one piece (AsyncLLMEngine._published), so a request is never counted
        # twice or missed.
        for request_id, error in acks:
            self.sink.on_accepted(request_id, error)
        self._publish_stats()

    def _add(self, command: AddCommand) -> Optional[BaseException]:
        try:
            self.core.add_request(command.request_id, command.prompt, command.params, command.hints,
                                  prompt_text=command.prompt_text, resume=command.resume)
        except Exception as e:  # EngineCore.add_request is atomic: nothing was added
            if not isinstance(e, ValueError):
                logger.exception("adding request %s failed", command.request_id)
                e = RequestFailedError(f"adding the request failed: {e!r}")
            return e
        return None

    def _step(self) -> None:
        core = self.core
        # The step's two phases, called here rather than through `core.step()`: requests a step
        # admits run from its scheduling on, though the model (a long prefill) may take seconds
        # more, so the waiting count the server's limit reads is published in between.
        scheduled = core.schedule()
        try:
            if self.step_trace is not None:
                self.step_trace.step_started(step_composition(
                    scheduled, core.scheduler.requests, core.kv_bytes_per_block))
            self.sink.on_waiting(core.num_waiting_requests())
            self.flush()
            serving_threads.before_step(scheduled.total_num_scheduled_tokens)
            result = core.execute(scheduled)
        except Exception as e:
            logger.exception("engine step failed before the model ran")
            result = core.fail_step(scheduled, e)
        self.sink.on_iteration(result.scheduler_output.total_num_scheduled_tokens)
        now = core.clock()
        for output in result.outputs:
            if output.request_id in result.expired:
                self.sink.on_expired(output, result.expired[output.request_id])
            else:
                self.sink.on_output(output, now)
        for rid, error in result.failed.items():
            logger.error("request %s failed in the engine: %r", rid, error)
            failed = RequestFailedError(f"the engine failed this request: {error!r}")
            failed.__cause__ = error
            self.sink.on_failed(rid, failed)

    def _publish_stats(self) -> None:
        self.sink.on_stats(self.core.get_stats(), len(self.core.states))

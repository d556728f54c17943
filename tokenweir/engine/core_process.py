"""The engine core in a process of its own: what `tokenweir serve` runs by default.

In one process, the engine thread and the event loop share one interpreter lock: the model's
Python between two kernels waits for the event loop's turn, and the torch team waits for that
thread, at every token. In its own process the engine loop (engine/core_loop.py, the same loop
the in-process engine thread runs) owns its interpreter; the server's process keeps the front
(streams, metrics, the stats log) and talks to it through two pipes:

- commands (add, abort, shutdown) from the event loop, pickled there (so a bad one fails its
  caller) and written by a sender thread: the engine reads commands only between steps, and a
  pipe full of them must not block the event loop for a step;
- the sink's calls from the engine, batched by the loop at its flush points (after a command
  batch, once a step has scheduled, after a step), replayed by one reader thread onto the front
  in order, so the front sees exactly what an in-process engine thread would have told it.

The engine process ignores SIGINT (the server decides when to stop) and ends when told to, or
when the server's end of the pipe closes. If it dies, the reader thread finds its pipe closed
and every request in flight fails with EngineDeadError; /health says so.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Optional

from tokenweir.config import EngineArgs
from tokenweir.core.scheduler import SchedulerStats
from tokenweir.engine.async_engine import STATS_LOG_INTERVAL_S, AsyncLLMEngine
from tokenweir.engine.client import EngineDeadError, ModelInfo
from tokenweir.engine.core_loop import Command, CommandSource, CoreLoop, ShutdownCommand
from tokenweir.engine.gc_heap import freeze_startup_heap
from tokenweir.engine.output import RequestOutput
from tokenweir.engine.output_delta import OutputDelta, OutputDeltaDecoder, OutputDeltaEncoder

logger = logging.getLogger("tokenweir")

@dataclass
class EngineInfo:
    """What the server's process learns from the engine process once the model is loaded."""

    model_info: ModelInfo
    tokenizer: Any
    max_num_batched_tokens: int
    stats: SchedulerStats
    gc_frozen_objects: int  # its startup heap, frozen (gc_heap.py)


@dataclass
class _Exit:
    reason: Optional[str]  # None: shut down as asked
    error: Optional[BaseException] = None  # why loading failed, raised again in the server's process


class ShippingSink:
    """A sink away from the front (the engine process; a cluster's replica): records the loop's
    calls and sends them as one batch on flush; outputs go as deltas (output_delta.py). `send`
    raises OSError once nobody receives any more."""

    def __init__(self, send: Callable[[list[tuple[str, tuple]]], None]) -> None:
        self.send = send
        self.calls: list[tuple[str, tuple]] = []
        self.deltas = OutputDeltaEncoder()
        self.server_gone = False

    def flush(self) -> None:
        if self.calls:
            calls, self.calls = self.calls, []
            if self.server_gone:
                return
            try:
                self.send(calls)
            except OSError:  # the server's process is gone: the command pipe's EOF stops the loop
                self.server_gone = True
                logger.info("the server's process is gone; the engine process stops")

    def on_accepted(self, request_id: str, error: Optional[BaseException]) -> None:
        self.calls.append(("on_accepted", (request_id, error)))

    def on_output(self, output: RequestOutput, now: float) -> None:
        self.calls.append(("on_output", (self.deltas.encode(output), now)))

    def on_expired(self, output: RequestOutput, message: str) -> None:
        self.calls.append(("on_expired", (self.deltas.encode(output), message)))

    def on_failed(self, request_id: str, error: BaseException) -> None:
        self.deltas.forget(request_id)
        self.calls.append(("on_failed", (request_id, error)))

    def on_iteration(self, num_scheduled_tokens: int) -> None:
        self.calls.append(("on_iteration", (num_scheduled_tokens,)))

    def on_waiting(self, num_waiting: int) -> None:
        self.calls.append(("on_waiting", (num_waiting,)))

    def on_stats(self, stats: SchedulerStats, num_unfinished: int) -> None:
        self.calls.append(("on_stats", (stats, num_unfinished)))


def _command_source(conn: Connection, idle_wait_s: Optional[float]) -> CommandSource:
    def next_commands(block: bool) -> list[Command]:
        commands: list[Command] = []
        if block and not conn.poll(idle_wait_s):
            return commands
        while conn.poll(0):
            try:
                commands.append(conn.recv())
            except EOFError:  # the server's process is gone
                commands.append(ShutdownCommand())
                break
        return commands
    return next_commands


def run_engine_process(args: EngineArgs, step_trace_path: Optional[str], idle_wait_s: Optional[float],
                       commands: Connection, events: Connection) -> None:
    """The engine process's main: load, report ready, run the loop, release, report the exit."""
    # Ctrl-C and a supervisor's SIGTERM reach the whole process group (systemd's default
    # KillMode signals every process of the service): the server drains its streams, then
    # closes the pipe, which ends this process. Dying at the signal would fail them all.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    from tokenweir.cli import configure_logging
    from tokenweir.engine.core import EngineCore
    from tokenweir.engine.step_trace import StepTrace

    configure_logging()
    try:
        core = EngineCore(args)
    except Exception as e:  # a bad model path or engine arg: the server raises it as it would in-process
        events.send(_Exit(f"loading the engine failed: {e!r}", e))
        return
    step_trace = StepTrace(step_trace_path) if step_trace_path else None
    if step_trace is not None:
        step_trace.write_header(core.describe())
    frozen = freeze_startup_heap()  # this process holds its one engine until it exits
    events.send(EngineInfo(ModelInfo(core.served_model_name, core.max_model_len, core.loaded.arch.vocab_size,
                                     core.default_sampling_params),
                           core.tokenizer, core.scheduler_config.max_num_batched_tokens, core.get_stats(), frozen))
    sink = ShippingSink(events.send)
    loop = CoreLoop(core, sink, step_trace, flush=sink.flush)
    reason: Optional[str] = None
    try:
        loop.run(_command_source(commands, idle_wait_s))
    except BaseException as e:
        logger.exception("the engine loop died")
        reason = f"the engine loop died: {e!r}"
    try:
        loop.release_all()
    except Exception:
        logger.exception("cleaning up the engine after it stopped failed")
    if not sink.server_gone:
        try:
            events.send(_Exit(reason))
        except OSError:
            pass  # gone since
    if step_trace is not None:
        step_trace.close()


class MPAsyncLLMEngine(AsyncLLMEngine):
    """AsyncLLMEngine's front, with the engine loop in a process of its own."""

    # How long `shutdown` waits for the engine process to finish its step and exit.
    shutdown_timeout_s = 30.0

    def __init__(self, args: EngineArgs, *, log_stats: Optional[bool] = None,
                 stats_interval_s: float = STATS_LOG_INTERVAL_S, step_trace_path: Optional[str] = None,
                 startup_timeout_s: Optional[float] = None) -> None:
        log_stats = not args.disable_log_stats if log_stats is None else log_stats
        context = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked threads or locks
        commands_r, self._commands_w = context.Pipe(duplex=False)
        self._events_r, events_w = context.Pipe(duplex=False)
        self.process = context.Process(
            target=run_engine_process, name="tokenweir-engine-core", daemon=True,
            args=(args, step_trace_path, stats_interval_s if log_stats else None, commands_r, events_w))
        self.process.start()
        commands_r.close()
        events_w.close()  # so the reader sees EOF once the engine process is gone
        try:
            if not self._events_r.poll(startup_timeout_s):
                raise RuntimeError(f"the engine process did not start within {startup_timeout_s} s")
            info = self._events_r.recv()
        except EOFError:
            self.process.join(5)
            info = _Exit(f"it exited with code {self.process.exitcode}")
        except BaseException:
            self.process.kill()
            raise
        if not isinstance(info, EngineInfo):
            self.process.join(5)
            if info.error is not None:
                raise info.error
            raise RuntimeError(f"the engine process did not start: {info.reason}")
        self.gc_frozen_objects = info.gc_frozen_objects
        self._deltas = OutputDeltaDecoder()  # the reader thread's
        self._init_front(info.model_info, info.tokenizer, args, info.max_num_batched_tokens, info.stats,
                         log_stats, stats_interval_s, time.monotonic)
        self._outbox: queue.SimpleQueue[Optional[bytes]] = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_commands, name="tokenweir-engine-sender", daemon=True)
        self._sender.start()
        self._thread = threading.Thread(target=self._run, name="tokenweir-engine-reader", daemon=True)
        self._thread.start()

    def _send(self, command: Command) -> None:
        self._outbox.put(ForkingPickler.dumps(command))  # what Connection.send writes

    def _send_commands(self) -> None:
        """The sender thread: writes the pickled commands in order, until told to stop."""
        while (data := self._outbox.get()) is not None:
            try:
                self._commands_w.send_bytes(data)
            except OSError:  # the engine process is gone; the reader fails everything
                return

    def shutdown(self) -> None:
        """Stop the engine process; requests in flight fail with EngineDeadError. A process
        that does not answer within `shutdown_timeout_s` (hung in a step, stopped) is killed."""
        self._submit(ShutdownCommand(), quiet=True)
        # The reader ends when the process reports its exit or its pipe closes.
        self._thread.join(self.shutdown_timeout_s)
        if self._thread.is_alive():
            logger.warning("the engine process did not stop within %.0f s; killing it", self.shutdown_timeout_s)
            self.process.kill()
            self._thread.join()
        self._outbox.put(None)
        self._sender.join()
        self.process.join(self.shutdown_timeout_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    # The engine process's sink calls, as the reader replays them: outputs arrive as deltas.

    def on_output(self, output: OutputDelta, now: float) -> None:  # type: ignore[override]
        super().on_output(self._deltas.decode(output), now)

    def on_expired(self, output: OutputDelta, message: str) -> None:  # type: ignore[override]
        super().on_expired(self._deltas.decode(output), message)

    def on_failed(self, request_id: str, error: BaseException) -> None:
        self._deltas.forget(request_id)
        super().on_failed(request_id, error)

    def _run(self) -> None:
        """The reader thread: replays the engine's sink calls onto this front, in order."""
        reason: BaseException
        try:
            while True:
                message = self._events_r.recv()
                if isinstance(message, _Exit):
                    reason = EngineDeadError(message.reason or "the engine was shut down")
                    break
                for name, call_args in message:
                    getattr(self, name)(*call_args)
        except EOFError:
            self.process.join(5)
            reason = EngineDeadError(f"the engine process exited with code {self.process.exitcode}")
        except BaseException as e:
            logger.exception("reading from the engine process failed")
            reason = EngineDeadError(f"reading from the engine process failed: {e!r}")
            self.process.kill()
        self._deltas.clear()
        self._die(reason)

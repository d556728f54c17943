"""EngineReplica: one engine in a Ray actor process, as the cluster's coordinator drives it.

The replica runs the same engine loop as `tokenweir serve`'s engine process (engine/core_loop.py)
in a thread of the actor, with the same shipping sink (outputs as deltas, the loop's calls in
batches). Instead of a pipe, the batches wait in the actor until the coordinator's `poll` takes
them: one Ray call per batch of steps, not per token. The actor is threaded, so `poll`,
`submit` and `ping`-like reads answer while a step runs.

A poll also says how long ago the engine loop last went round (a replica stuck in a step, or
anywhere else, is hung even though its actor answers) and, every CACHE_REPORT_INTERVAL_S, the
keys of its prefix cache, taken on the engine thread between steps, for the router's affinity.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from tokenweir.cluster.dispatch import mean_step_time
from tokenweir.config import CacheConfig, EngineArgs, SchedulerConfig
from tokenweir.core.block_hash import BlockHash
from tokenweir.core.scheduler import SchedulerStats
from tokenweir.engine.client import ModelInfo
from tokenweir.engine.core_loop import Command, CoreLoop, ShutdownCommand, take_commands
from tokenweir.engine.core_process import ShippingSink

logger = logging.getLogger("tokenweir")

CACHE_REPORT_INTERVAL_S = 0.5
IDLE_WAIT_S = 1.0  # how long the idle loop waits for a command before looking again


@dataclass
class ReplicaInfo:
    """What the coordinator learns once a replica has loaded its model."""

    model_info: ModelInfo
    tokenizer: Any
    scheduler_config: SchedulerConfig
    cache_config: CacheConfig
    stats: SchedulerStats
    pid: int  # its process (the failover tests kill it)


@dataclass
class ReplicaReport:
    batches: list[list[tuple[str, tuple]]]  # the loop's sink calls since the last poll, in order
    cached_blocks: Optional[frozenset[BlockHash]]  # its prefix cache's keys when a report was due, else None
    step_time_s: float  # recent mean step time
    # Since the engine loop last went round (it asks for commands between steps, and at least
    # every IDLE_WAIT_S when idle): a step, command or anything else it is stuck in shows here.
    loop_age_s: float
    error: Optional[str]  # the engine loop died, and why


class _ReplicaSink(ShippingSink):
    """The shipping sink, also timing steps and taking the prefix cache's keys now and then
    (on the engine thread, between steps: the pool is not changing then)."""

    def __init__(self, send: Callable[[list[tuple[str, tuple]]], None], cached_keys: Callable[[], frozenset]) -> None:
        super().__init__(send)
        self._cached_keys = cached_keys
        self.step_started: Optional[float] = None
        self.step_time_s = 0.0
        self.cached_blocks: Optional[frozenset[BlockHash]] = None  # taken by poll
        self._cache_reported = 0.0

    def on_waiting(self, num_waiting: int) -> None:  # once a step has scheduled, before the model runs
        self.step_started = time.monotonic()
        super().on_waiting(num_waiting)

    def on_iteration(self, num_scheduled_tokens: int) -> None:
        if self.step_started is not None:
            self.step_time_s = mean_step_time(self.step_time_s, time.monotonic() - self.step_started)
        self.step_started = None
        super().on_iteration(num_scheduled_tokens)

    def on_stats(self, stats: SchedulerStats, num_unfinished: int) -> None:
        now = time.monotonic()
        # Also as it goes idle: an idle loop publishes nothing more, and its cache is final.
        if now - self._cache_reported >= CACHE_REPORT_INTERVAL_S or not num_unfinished:
            self._cache_reported = now
            self.cached_blocks = self._cached_keys()
        super().on_stats(stats, num_unfinished)


class EngineReplica:
    """The body of the Ray actor (cluster/coordinator.py makes it remote)."""

    def __init__(self, args: EngineArgs, num_threads: int) -> None:
        import torch

        from tokenweir.cli import configure_logging
        from tokenweir.engine.core import EngineCore

        configure_logging()
        torch.set_num_threads(num_threads)
        self.core = EngineCore(args)
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._ready = threading.Condition()
        self._batches: list[list[tuple[str, tuple]]] = []
        self._error: Optional[str] = None
        self._loop_seen = time.monotonic()
        pool = self.core.scheduler.kv_cache_manager.block_pool
        self._sink = _ReplicaSink(self._receive, lambda: frozenset(pool.cached_block_hash_to_block))
        self._loop = CoreLoop(self.core, self._sink, flush=self._sink.flush)
        self._thread = threading.Thread(target=self._run, name="tokenweir-replica-engine", daemon=True)
        self._thread.start()

    def info(self) -> ReplicaInfo:
        core = self.core
        return ReplicaInfo(ModelInfo(core.served_model_name, core.max_model_len, core.loaded.arch.vocab_size,
                                     core.default_sampling_params),
                           core.tokenizer, core.scheduler_config, core.cache_config, core.get_stats(), os.getpid())

    def submit(self, commands: list[Command]) -> None:
        for command in commands:
            self._commands.put(command)

    def poll(self, wait_s: float) -> ReplicaReport:
        """What happened since the last poll, waiting up to `wait_s` for something to happen."""
        with self._ready:
            if not self._batches and self._error is None:
                self._ready.wait(wait_s)
            batches, self._batches = self._batches, []
        sink = self._sink
        cached, sink.cached_blocks = sink.cached_blocks, None
        return ReplicaReport(batches, cached, sink.step_time_s, time.monotonic() - self._loop_seen, self._error)

    def held(self) -> dict[str, int]:
        """What the engine holds; all zeros once it is idle and released everything. Read it
        while the replica is idle (its loop then waits for commands)."""
        core, scheduler = self.core, self.core.scheduler
        kv = scheduler.kv_cache_manager
        host = kv.host_pool
        return {"requests": len(scheduler.requests), "waiting": len(scheduler.waiting),
                "running": len(scheduler.running), "swapped": len(scheduler.swapped),
                "steps_in_flight": int(scheduler.step_in_flight is not None),
                "device_blocks_in_use": kv.block_pool.num_blocks - kv.block_pool.get_num_free_blocks(),
                "host_blocks_in_use": 0 if host is None else host.num_blocks - host.get_num_free_blocks(),
                "block_tables": len(kv.req_to_blocks) + len(kv.req_to_host_blocks),
                "output_states": len(core.states), "runner_requests": len(core.runner.requests),
                "generators": len(core.runner.generators)}

    def shutdown(self) -> None:
        """Stop the loop (what it holds is released) and wait for it."""
        self._commands.put(ShutdownCommand())
        self._thread.join()

    # ---------------------------------------------------------------- the engine thread

    def _receive(self, calls: list[tuple[str, tuple]]) -> None:
        with self._ready:
            self._batches.append(calls)
            self._ready.notify_all()

    def _next_commands(self, block: bool) -> list[Command]:
        self._loop_seen = time.monotonic()
        return take_commands(self._commands, block, IDLE_WAIT_S)

    def _run(self) -> None:
        try:
            self._loop.run(self._next_commands)
        except BaseException as e:
            logger.exception("the replica's engine loop died")
            with self._ready:
                self._error = f"the engine loop died: {e!r}"
                self._ready.notify_all()
        try:
            self._loop.release_all()
        except Exception:
            logger.exception("cleaning up the replica's engine after it stopped failed")

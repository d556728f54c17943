"""ClusterEngine: N engine replicas on Ray behind one global queue; the server's EngineClient.

The front (streams, metrics, the stats log line) is AsyncLLMEngine's, as for one engine. Behind
it, one coordinator thread owns everything else and is the only one to touch it:

- **The global queue.** An accepted request (checked here with the engine's own checks, so a
  bad one is refused before it waits) waits in a queue made by the replicas' scheduling policy
  (the same classes, in the same order). It is dispatched when some replica has room: fewer than
  `dispatch_queue_depth` requests there that it has not started. Routing late means the router
  reads fresh loads and caches, and a request never waits behind a dead or slow replica.
- **Routing.** The router (cluster/routing.py) picks among the replicas with room, from their
  load (running, waiting, KV use, step time) and the keys of their prefix caches (reported every
  half second; a prompt routed there counts at once). A prompt's keys are the replicas' own
  (core/kv_cache_manager.extend_block_hashes, keyed alike), so a match is a real hit.
- **Replicas.** Each is an `EngineReplica` actor running the engine loop; a poller thread per
  replica long-polls it (one Ray call per batch of steps) and hands the batches to the
  coordinator, which replays them onto the front, outputs as deltas.
- **Failover.** A replica whose actor dies (its process killed) or hangs (a step running longer
  than `replica_hang_timeout`, or no answer to a poll that long after it was due) is killed and
  its requests go back to the front of the global queue, each with what its client already has
  (ResumeState: tokens, logprobs). The next replica continues them as a recompute preemption
  would (Request.restore_outputs), so a stream neither repeats nor skips a token, greedy output
  is what it would have been, and a seeded request keeps its random stream. A request not yet
  started simply starts elsewhere. The replica is restarted in the background.

Time: on a local Ray (one machine, one monotonic clock) the coordinator stamps each request's
arrival, so replicas' TTFTs count the global queue and any failover; joining a remote cluster
(--ray-address), each replica stamps its own.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from tokenweir.cluster.config import ClusterConfig
from tokenweir.cluster.replica import EngineReplica, ReplicaInfo, ReplicaReport
from tokenweir.cluster.routing import ReplicaLoad, RouteRequest, create_router
from tokenweir.cluster.stats import merge_stats, retire
from tokenweir.config import EngineArgs
from tokenweir.core.block_hash import BlockHash, BlockHasher
from tokenweir.core.kv_cache_manager import extend_block_hashes
from tokenweir.core.policies import create_policy
from tokenweir.core.scheduler import SchedulerStats
from tokenweir.engine.async_engine import STATS_LOG_INTERVAL_S, AsyncLLMEngine
from tokenweir.engine.client import EngineDeadError, RequestFailedError
from tokenweir.engine.core_loop import AbortCommand, AddCommand, Command, ShutdownCommand, take_commands
from tokenweir.engine.output import CompletionOutput, RequestMetrics, RequestOutput
from tokenweir.engine.output_delta import OutputDeltaDecoder
from tokenweir.engine.request_checks import check_prompt, checked_params, tokenize
from tokenweir.request import Request, ResumeState

logger = logging.getLogger("tokenweir")

POLL_WAIT_S = 0.5  # a poll returns at once when the replica has news, after this at the latest
RESTART_BACKOFF_S = 2.0


def start_ray(config: ClusterConfig) -> bool:
    """Connect to the cluster at `ray_address`, or start a local one on 127.0.0.1 with a CPU
    slot for every replica. Returns whether this process started or joined Ray (and so must
    shut its connection down: `ray.shutdown()` stops a local Ray it started, and nothing else)."""
    import ray

    if ray.is_initialized():
        return False
    if config.ray_address is not None:
        ray.init(address=config.ray_address, include_dashboard=False, log_to_driver=True)
    else:
        ray.init(num_cpus=max(os.cpu_count() or 1, config.data_parallel_size), include_dashboard=False,
                 _node_ip_address="127.0.0.1", log_to_driver=True)
    return True


@dataclass
class _Entry:
    """A request the coordinator holds: queued, or on a replica."""

    command: AddCommand  # checked, its prompt as token ids
    request: Request  # for the global queue's policy
    route: RouteRequest
    slot: Optional[int] = None  # the replica it is on; None while queued
    last: Optional[RequestOutput] = None  # the newest output its client was given
    aborted: bool = False


@dataclass
class _Slot:
    """One replica position: its current actor (restarted ones get a new incarnation)."""

    index: int
    actor: Any = None
    incarnation: int = 0
    up: bool = False
    info: Optional[ReplicaInfo] = None
    stats: Optional[SchedulerStats] = None
    num_waiting: int = 0
    step_time_s: float = 0.0
    in_transit: set[str] = field(default_factory=set)  # sent, not acknowledged yet
    requests: set[str] = field(default_factory=set)
    decoder: OutputDeltaDecoder = field(default_factory=OutputDeltaDecoder)
    cached_blocks: set[BlockHash] = field(default_factory=set)
    failed_starts: int = 0  # in a row


class ClusterEngine(AsyncLLMEngine):
    """AsyncLLMEngine's front over `data_parallel_size` replicas; implements `EngineClient`."""

    def __init__(self, args: EngineArgs, cluster: ClusterConfig, *, log_stats: Optional[bool] = None,
                 stats_interval_s: float = STATS_LOG_INTERVAL_S) -> None:
        import ray

        self.args, self.cluster = args, cluster
        self._owns_ray = start_ray(cluster)
        # Each replica's torch threads: the machine's cores shared out (at least one each).
        self._num_threads = max(1, (os.cpu_count() or 1) // cluster.data_parallel_size)
        self._actor_class = ray.remote(num_cpus=1, max_concurrency=4, max_restarts=0)(EngineReplica)
        actors = [self._actor_class.remote(args, self._num_threads) for _ in range(cluster.data_parallel_size)]
        try:
            infos: list[ReplicaInfo] = ray.get([a.info.remote() for a in actors],
                                               timeout=cluster.replica_startup_timeout)
        except BaseException:
            for actor in actors:
                ray.kill(actor)
            if self._owns_ray:
                ray.shutdown()
            raise
        first = infos[0]
        self._init_front(first.model_info, copy.deepcopy(first.tokenizer), args,
                         first.scheduler_config.max_num_batched_tokens,
                         merge_stats([i.stats for i in infos], None, 0), log_stats, stats_interval_s, time.monotonic)
        # The coordinator thread's own: the server's threads use `self.tokenizer`.
        self._check_tokenizer = copy.deepcopy(first.tokenizer)
        self._cache_config = first.cache_config
        self._hasher = BlockHasher(first.cache_config.prefix_cache_hash_key)
        self._policy = create_policy(first.scheduler_config.policy, first.scheduler_config.policy_config)
        self._queue = self._policy.make_waiting_queue()
        self._router = create_router(cluster.routing_policy, cluster.router)
        self._entries: dict[str, _Entry] = {}
        self._retired: Optional[SchedulerStats] = None  # the counters of replicas gone
        self._events: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._pollers: list[threading.Thread] = []
        self._slots = [_Slot(i) for i in range(cluster.data_parallel_size)]
        for slot, actor, info in zip(self._slots, actors, infos):
            self._bring_up(slot, actor, info)
        logger.info("cluster: %d replicas on Ray, routing %s, dispatch queue depth %d, %d threads each",
                    len(self._slots), cluster.routing_policy, cluster.dispatch_queue_depth, self._num_threads)
        self._thread = threading.Thread(target=self._run, name="tokenweir-coordinator", daemon=True)
        self._thread.start()

    # ================================================================ event-loop API

    def shutdown(self) -> None:
        """Stop the replicas (and a local Ray this engine started); requests in flight fail with
        EngineDeadError."""
        self._submit(ShutdownCommand(), quiet=True)
        self._thread.join()

    def replica_pids(self) -> list[Optional[int]]:
        """Each replica slot's process id (None while it is down)."""
        return [s.info.pid if s.up and s.info is not None else None for s in self._slots]

    def replica_stats(self) -> list[Optional[SchedulerStats]]:
        """Each replica slot's latest stats (None while it is down)."""
        return [s.stats if s.up else None for s in self._slots]

    def replica_held(self) -> list[dict[str, int]]:
        """What each live replica's engine holds (EngineReplica.held): all zeros when idle."""
        import ray

        return ray.get([s.actor.held.remote() for s in self._slots if s.up])

    def _send(self, command: Command) -> None:
        self._events.put(("command", command))

    # ================================================================ the coordinator thread

    def _run(self) -> None:
        reason: BaseException = EngineDeadError("the engine was shut down")
        try:
            stop = False
            while not stop:
                events = take_commands(self._events, True, POLL_WAIT_S)
                for event in events:
                    stop = self._handle(event) or stop
                if stop:
                    break
                self._dispatch()
                if events:
                    self._publish()
                if not any(s.up for s in self._slots) and not self._restarting():
                    raise RuntimeError("every replica is down and none could be restarted")
        except BaseException as e:
            logger.exception("the cluster's coordinator died")
            reason = EngineDeadError(f"the cluster's coordinator died: {e!r}")
        self._die(reason)
        self._entries.clear()
        self._stop_replicas()

    def _handle(self, event: tuple) -> bool:
        """One event; returns whether it was a shutdown."""
        kind = event[0]
        if kind == "command":
            command = event[1]
            if isinstance(command, ShutdownCommand):
                return True
            if isinstance(command, AddCommand):
                self._accept(command)
            else:
                self._abort(command.request_id)
        elif kind == "report":
            self._replay(*event[1:])
        elif kind == "lost":
            self._lose(*event[1:])
        elif kind == "up":
            _, index, incarnation, actor, info = event
            slot = self._slots[index]
            if slot.incarnation == incarnation:
                logger.info("replica %d restarted (pid %d)", index, info.pid)
                self._bring_up(slot, actor, info)
        elif kind == "start_failed":
            _, index, incarnation, why = event
            slot = self._slots[index]
            if slot.incarnation == incarnation:
                slot.failed_starts += 1
                logger.error("restarting replica %d failed (%d in a row): %s", index, slot.failed_starts, why)
                if slot.failed_starts <= self.cluster.max_replica_restarts:
                    self._restart(slot)
        return False

    # ---------------------------------------------------------------- requests

    def _accept(self, command: AddCommand) -> None:
        """Check a request as its replica will, then queue it (or refuse it: the caller's
        add_request raises the error)."""
        rid = command.request_id
        try:
            vocab = self.model_info.vocab_size
            params = checked_params(command.params, command.hints, vocab)
            prompt_ids = tokenize(self._check_tokenizer, command.prompt)
            check_prompt(prompt_ids, vocab, self.model_info.max_model_len)
            hints = command.hints
            if hints.arrival_time is None and self.cluster.ray_address is None:
                hints = dataclasses.replace(hints, arrival_time=self._clock())
            request = Request(rid, prompt_ids, params, arrival_time=self._clock() if hints.arrival_time is None
                              else hints.arrival_time, hints=hints)
        except ValueError as e:
            self.on_accepted(rid, e)
            return
        except Exception as e:
            logger.exception("checking request %s failed", rid)
            self.on_accepted(rid, RequestFailedError(f"adding the request failed: {e!r}"))
            return
        prompt_text = command.prompt if isinstance(command.prompt, str) else command.prompt_text
        self._entries[rid] = _Entry(AddCommand(rid, prompt_ids, params, hints, prompt_text), request,
                                    RouteRequest(rid, self._block_hashes(request), len(prompt_ids)))
        self._queue.add(request)
        self.on_accepted(rid, None)

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        """The prompt's prefix-cache keys as a replica computes them (none without caching)."""
        cfg = self._cache_config
        hashes: list[BlockHash] = []
        if cfg.enable_prefix_caching:
            kv_int8 = cfg.int8_kv_min_priority is not None and request.priority >= cfg.int8_kv_min_priority
            block_size = cfg.int8_block_size if kv_int8 else cfg.block_size
            extend_block_hashes(self._hasher, hashes, request.prompt_token_ids, block_size,
                                request.num_prompt_tokens // block_size, request.cache_salt, kv_int8)
        return hashes

    def _abort(self, rid: str) -> None:
        entry = self._entries.get(rid)
        if entry is None:
            return  # finished, or never accepted
        if entry.slot is None:
            self._queue.remove(entry.request)
            del self._entries[rid]
            self._deliver(self._aborted_output(entry), self._clock())
        else:
            entry.aborted = True
            self._slots[entry.slot].actor.submit.remote([AbortCommand(rid)])

    def _aborted_output(self, entry: _Entry) -> RequestOutput:
        """The final output of a request aborted here (queued, or its replica lost): what its
        client has, finished by abort."""
        now = self._clock()
        last = entry.last
        completion = (dataclasses.replace(last.outputs[0], finish_reason="abort", stop_reason=None) if last
                      else CompletionOutput(index=0, text="", token_ids=[], finish_reason="abort"))
        metrics = (dataclasses.replace(last.metrics, finished_time=now) if last
                   else RequestMetrics(entry.request.arrival_time, None, None, now, 0, 0))
        return RequestOutput(entry.command.request_id, entry.command.prompt_text, list(entry.command.prompt),
                             [completion], True, metrics)

    def _dispatch(self) -> None:
        """Send queued requests, in the policy's order, to replicas with room."""
        if not len(self._queue):
            return
        depth = self.cluster.dispatch_queue_depth
        now = self._clock()
        self._policy.begin_step(now, self._queue, [])
        while len(self._queue):
            room = [s for s in self._slots if s.up and s.num_waiting + len(s.in_transit) < depth]
            if not room:
                break
            entry = self._entries[self._queue.pop().request_id]
            slot = self._slots[self._router.choose(entry.route, [self._load(s) for s in room])]
            entry.slot = slot.index
            slot.in_transit.add(entry.command.request_id)
            slot.requests.add(entry.command.request_id)
            slot.cached_blocks.update(entry.route.block_hashes)  # cached there once it runs
            slot.actor.submit.remote([dataclasses.replace(entry.command, resume=self._resume_state(entry))])
        self._policy.end_step(now)

    @staticmethod
    def _resume_state(entry: _Entry) -> Optional[ResumeState]:
        """What the client already has of a request that goes on elsewhere (None: nothing)."""
        if entry.last is None or not entry.last.outputs[0].token_ids:
            return None
        completion = entry.last.outputs[0]
        return ResumeState(tuple(completion.token_ids),
                           None if completion.logprobs is None else tuple(completion.logprobs),
                           completion.cumulative_logprob or 0.0)

    def _load(self, slot: _Slot) -> ReplicaLoad:
        stats = slot.stats
        return ReplicaLoad(slot.index, stats.num_running if stats else 0, slot.num_waiting + len(slot.in_transit),
                           stats.kv_cache_usage if stats else 0.0, slot.info.scheduler_config.max_num_seqs,
                           slot.step_time_s, slot.cached_blocks)

    # ---------------------------------------------------------------- replicas' reports

    def _replay(self, index: int, incarnation: int, report: ReplicaReport) -> None:
        """A replica's sink calls, onto the front, in order."""
        slot = self._slots[index]
        if slot.incarnation != incarnation or not slot.up:
            return  # from a replica already given up
        slot.step_time_s = report.step_time_s
        if report.cached_blocks is not None:
            slot.cached_blocks = set(report.cached_blocks)
        for batch in report.batches:
            for name, call_args in batch:
                getattr(self, f"_replica_{name}")(slot, *call_args)

    def _owned(self, slot: _Slot, rid: str) -> Optional[_Entry]:
        entry = self._entries.get(rid)
        return entry if entry is not None and entry.slot == slot.index else None

    def _settle(self, slot: _Slot, rid: str) -> None:
        """The request has ended on this replica."""
        del self._entries[rid]
        slot.requests.discard(rid)

    def _replica_on_accepted(self, slot: _Slot, rid: str, error: Optional[BaseException]) -> None:
        slot.in_transit.discard(rid)
        entry = self._owned(slot, rid)
        if entry is None:
            return
        if error is not None:  # a replica refused what the coordinator's checks let through
            self._settle(slot, rid)
            self._fail_stream(rid, error)
        elif entry.aborted:  # the abort may have overtaken the add (an actor's threads run calls in any order)
            slot.actor.submit.remote([AbortCommand(rid)])

    def _replica_on_output(self, slot: _Slot, delta: Any, now: float) -> None:
        output = slot.decoder.decode(delta)
        entry = self._owned(slot, output.request_id)
        if entry is None:
            return
        entry.last = output
        if output.finished:
            self._settle(slot, output.request_id)
        self._deliver(output, self._clock())  # the front's clock: gaps between replicas' outputs are real

    def _replica_on_expired(self, slot: _Slot, delta: Any, message: str) -> None:
        output = slot.decoder.decode(delta)
        if self._owned(slot, output.request_id) is not None:
            self._settle(slot, output.request_id)
            self._expire(output, message)

    def _replica_on_failed(self, slot: _Slot, rid: str, error: BaseException) -> None:
        slot.decoder.forget(rid)
        if self._owned(slot, rid) is not None:
            self._settle(slot, rid)
            self._fail_stream(rid, error)

    def _replica_on_iteration(self, slot: _Slot, num_scheduled_tokens: int) -> None:
        self.metrics.record_iteration(num_scheduled_tokens)

    def _replica_on_waiting(self, slot: _Slot, num_waiting: int) -> None:
        slot.num_waiting = num_waiting

    def _replica_on_stats(self, slot: _Slot, stats: SchedulerStats, num_unfinished: int) -> None:
        slot.stats = stats
        slot.num_waiting = stats.num_waiting

    def _publish(self) -> None:
        live = [s.stats for s in self._slots if s.up and s.stats is not None]
        in_transit = sum(len(s.in_transit) for s in self._slots)
        self.on_stats(merge_stats(live, self._retired, len(self._queue) + in_transit), len(self._entries))

    # ---------------------------------------------------------------- failover

    def _lose(self, index: int, incarnation: int, why: str) -> None:
        """A replica died or hung: kill it, requeue its requests where the client's streams
        stand, restart it."""
        import ray

        slot = self._slots[index]
        if slot.incarnation != incarnation or not slot.up:
            return
        slot.up = False
        logger.error("replica %d lost (%s); its %d requests continue on the others", index, why, len(slot.requests))
        if slot.stats is not None:
            self._retired = retire(self._retired, slot.stats)
        try:
            ray.kill(slot.actor, no_restart=True)
        except Exception:
            pass  # already gone
        entries = sorted((self._entries[rid] for rid in slot.requests), key=lambda e: e.request.arrival_time)
        for entry in reversed(entries):  # each to the queue's front: the oldest ends up first
            entry.slot = None
            if entry.aborted:
                del self._entries[entry.command.request_id]
                self._deliver(self._aborted_output(entry), self._clock())
            else:
                self._queue.push_front(entry.request)
        slot.requests.clear()
        slot.in_transit.clear()
        slot.decoder.clear()
        slot.cached_blocks = set()
        slot.stats, slot.num_waiting, slot.step_time_s = None, 0, 0.0
        self._restart(slot)

    def _restart(self, slot: _Slot) -> None:
        slot.incarnation += 1
        incarnation, delay = slot.incarnation, RESTART_BACKOFF_S * slot.failed_starts
        threading.Thread(target=self._start_replica, args=(slot.index, incarnation, delay),
                         name=f"tokenweir-replica-{slot.index}-start", daemon=True).start()

    def _restarting(self) -> bool:
        return any(s.failed_starts <= self.cluster.max_replica_restarts for s in self._slots if not s.up)

    def _start_replica(self, index: int, incarnation: int, delay_s: float) -> None:
        import ray

        if self._stopping.wait(delay_s):
            return
        actor = None
        try:
            actor = self._actor_class.remote(self.args, self._num_threads)
            info = ray.get(actor.info.remote(), timeout=self.cluster.replica_startup_timeout)
        except Exception as e:
            if actor is not None:
                ray.kill(actor)
            self._events.put(("start_failed", index, incarnation, repr(e)))
            return
        self._events.put(("up", index, incarnation, actor, info))

    def _bring_up(self, slot: _Slot, actor: Any, info: ReplicaInfo) -> None:
        slot.actor, slot.info, slot.stats, slot.up, slot.failed_starts = actor, info, info.stats, True, 0
        poller = threading.Thread(target=self._poll, args=(slot.index, slot.incarnation, actor),
                                  name=f"tokenweir-replica-{slot.index}-poller", daemon=True)
        self._pollers.append(poller)
        poller.start()

    def _poll(self, index: int, incarnation: int, actor: Any) -> None:
        """A poller thread: a replica's reports to the coordinator, until it is lost or we stop."""
        import ray
        from ray.exceptions import GetTimeoutError

        hang = self.cluster.replica_hang_timeout
        while not self._stopping.is_set():
            try:
                report: ReplicaReport = ray.get(actor.poll.remote(POLL_WAIT_S), timeout=POLL_WAIT_S + hang)
            except GetTimeoutError:
                why = f"no answer to a poll within {hang:g} s"
            except Exception as e:
                why = f"its actor died: {type(e).__name__}"
            else:
                self._events.put(("report", index, incarnation, report))
                if report.error is None and report.step_age_s <= hang:
                    continue
                why = report.error or f"a step has run for {report.step_age_s:.0f} s"
            if not self._stopping.is_set():
                self._events.put(("lost", index, incarnation, why))
            return

    def _stop_replicas(self) -> None:
        import ray

        self._stopping.set()
        live = [s for s in self._slots if s.up]
        for slot in live:
            slot.up = False
        try:
            ray.get([s.actor.shutdown.remote() for s in live], timeout=30)
        except Exception:
            logger.warning("not every replica shut down cleanly; killing them")
        for slot in live:
            try:
                ray.kill(slot.actor)
            except Exception:
                pass
        for poller in self._pollers:
            poller.join(POLL_WAIT_S + 5)
        if self._owns_ray:
            ray.shutdown()

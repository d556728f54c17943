"""ClusterEngine: N engine replicas on Ray behind one global queue; the server's EngineClient.

The front (streams, metrics, the stats log line) is AsyncLLMEngine's, as for one engine. Behind
it, one coordinator thread owns everything else and is the only one to touch it:

- **The global queue.** An accepted request (checked here with the engine's own checks, so a
  bad one is refused before it waits) waits in a queue made by the replicas' scheduling policy
  (the same classes, in the same order). It is dispatched once the replica its router picks has
  room: fewer than `dispatch_queue_depth` requests there that it has not started. Routing late
  means the router reads fresh loads and caches, and a request never waits behind a dead replica.
- **Routing.** The router (cluster/routing.py) picks among the live replicas, from their load
  (running, waiting, KV use, step time) and the keys of their prefix caches (as last reported,
  and those of the prompts each holds now). A prompt's keys are the replicas' own
  (core/kv_cache_manager.extend_block_hashes, keyed alike), so a match is a real hit. A request
  whose replica has no room keeps its place; a few behind it may go to replicas with room.
- **Replicas.** Each is an `EngineReplica` actor running the engine loop; a poller thread per
  replica long-polls it (a Ray call returns everything the loop flushed since the last, about
  twice a step while busy, not once per token) and hands the batches to the coordinator, which
  replays them onto the front, outputs as deltas. Requests travel to replicas under ids of
  their own (one per dispatch), so a client may reuse an id while its aborted predecessor is
  still winding down on a replica.
- **Failover.** A replica whose actor dies (its process killed), whose engine loop dies, or that
  hangs (its loop stuck, in a step or elsewhere, longer than `replica_hang_timeout`, or no
  answer to a poll that long after it was due), or whose report cannot be read, is killed, and
  its requests go back to the global queue (`push_front`: ahead of the rest where the policy's
  order allows), each with what its client already has (ResumeState: tokens, logprobs, times).
  The next replica continues them as a recompute preemption would (Request.restore), so a
  stream neither repeats nor skips a token, greedy output is what it would have been, and a
  seeded request keeps its random stream. A request not yet started simply starts elsewhere.
  One that was on `max_request_failovers` + 1 lost replicas fails instead (it may be what
  kills them). The replica is restarted in the background.

Time: on a local Ray (one machine, one monotonic clock) the coordinator stamps each request's
arrival (unless the caller did), so replicas' TTFTs count the global queue and any failover, and
a resumed request keeps its first-token and last-token times. Joining a remote cluster
(--ray-address), where clocks differ, each replica stamps its own arrivals (a caller's time is
dropped) and a resumed request's times start again.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from tokenweir.cluster.config import ClusterConfig
from tokenweir.cluster.dispatch import CacheView, dispatch_round, route_request
from tokenweir.cluster.replica import EngineReplica, ReplicaInfo, ReplicaReport
from tokenweir.cluster.routing import ReplicaLoad, RouteRequest, create_router
from tokenweir.cluster.stats import merge_stats, retire
from tokenweir.config import EngineArgs
from tokenweir.core.block_hash import BlockHasher
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
        try:
            ray.init(address=config.ray_address, include_dashboard=False, log_to_driver=True)
        except ConnectionError as e:
            refusal = token_refusal(e)
            if refusal is None:
                raise
            # Ray says only "Failed to connect"; why is in its cause chain, which the CLI's
            # error line does not show. A driver joining by address sends no token unless told to.
            raise ConnectionError(f"{e}: the cluster checks tokens and refused this one ({refusal}). Set "
                                  "RAY_AUTH_MODE=token, with the cluster's token in ~/.ray/auth_token, "
                                  "RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH") from e
    else:
        # "local": a Ray of its own even where another runs on this machine. Without an address
        # ray.init joins the one `ray start` left its address for (or RAY_ADDRESS names), and
        # refuses num_cpus there: the server would not start.
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, config.data_parallel_size),
                 include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=True)
    return True


def token_refusal(error: BaseException) -> Optional[BaseException]:
    """The cluster's refusal of this driver's token (or of its missing one) in the cause chain of
    `error`, a failed ray.init; None if that is not why it failed."""
    from ray.exceptions import AuthenticationError

    seen: Optional[BaseException] = error
    while seen is not None:
        if isinstance(seen, AuthenticationError) or "InvalidAuthToken" in str(seen):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


@dataclass
class _Entry:
    """A live request the coordinator holds: queued, or on a replica."""

    command: AddCommand  # checked, its prompt as token ids
    request: Request  # for the global queue's policy
    route: RouteRequest
    slot: Optional[int] = None  # the replica it is on; None while queued
    dispatch_id: str = ""  # its id on that replica (a new one for every dispatch)
    last: Optional[RequestOutput] = None  # the newest output its client was given
    last_output_time: Optional[float] = None  # when that output reached the front
    num_failovers: int = 0  # replicas lost while it was on them


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
    in_transit: set[str] = field(default_factory=set)  # dispatch ids sent, not acknowledged yet
    # Dispatch ids aborted there whose final output has not come back: an abort that overtook
    # its add (an actor's threads run calls in any order) is sent again on the add's ack.
    aborting: set[str] = field(default_factory=set)
    decoder: OutputDeltaDecoder = field(default_factory=OutputDeltaDecoder)
    cache: CacheView = field(default_factory=CacheView)
    failed_starts: int = 0  # in a row


class ClusterEngine(AsyncLLMEngine):
    """AsyncLLMEngine's front over `data_parallel_size` replicas; implements `EngineClient`."""

    def __init__(self, args: EngineArgs, cluster: ClusterConfig, *, log_stats: Optional[bool] = None,
                 stats_interval_s: float = STATS_LOG_INTERVAL_S) -> None:
        import ray

        self.args, self.cluster = args, cluster
        self._owns_ray = start_ray(cluster)
        self._stopping = threading.Event()
        self._starters: list[threading.Thread] = []
        actors: list[Any] = []
        try:
            self._actor_class = self._replica_actor_class()
            actors = [self._new_replica() for _ in range(cluster.data_parallel_size)]
            infos: list[ReplicaInfo] = ray.get([a.info.remote() for a in actors],
                                               timeout=cluster.replica_startup_timeout)
            first = infos[0]
            self._init_front(first.model_info, copy.deepcopy(first.tokenizer), args,
                             first.scheduler_config.max_num_batched_tokens,
                             merge_stats([i.stats for i in infos], None, 0), log_stats, stats_interval_s,
                             time.monotonic)
            # The coordinator thread's own: the server's threads use `self.tokenizer`.
            self._check_tokenizer = copy.deepcopy(first.tokenizer)
            self._cache_config = first.cache_config
            self._hasher = BlockHasher(first.cache_config.prefix_cache_hash_key)
            self._policy = create_policy(first.scheduler_config.policy, first.scheduler_config.policy_config)
            self._queue = self._policy.make_waiting_queue()
            self._router = create_router(cluster.routing_policy, cluster.router)
        except BaseException:
            for actor in actors:
                _kill(actor)
            if self._owns_ray:
                ray.shutdown()
            raise
        self._entries: dict[str, _Entry] = {}  # by the client's request id
        self._dispatched: dict[str, _Entry] = {}  # by dispatch id
        self._dispatch_ids = itertools.count()
        self._retired: Optional[SchedulerStats] = None  # the counters of replicas gone
        self._events: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._pollers: list[threading.Thread] = []
        self._slots = [_Slot(i) for i in range(cluster.data_parallel_size)]
        for slot, actor, info in zip(self._slots, actors, infos):
            self._bring_up(slot, actor, info)
        logger.info("cluster: %d replicas on Ray, routing %s, dispatch queue depth %d, %d threads each",
                    len(self._slots), cluster.routing_policy, cluster.dispatch_queue_depth, self._num_threads)
        self._thread = threading.Thread(target=self._run, name="tokenweir-coordinator", daemon=True)
        self._thread.start()

    def _replica_actor_class(self) -> Any:
        """EngineReplica as a Ray actor: a CPU slot each, the machine's cores shared out as
        torch and OpenMP threads (Ray would set OMP_NUM_THREADS=1), and a GPU each when the
        engine is to run on CUDA and the cluster has GPUs."""
        import ray

        self._num_threads = max(1, len(os.sched_getaffinity(0)) // self.cluster.data_parallel_size)
        num_gpus = 1 if self.args.device != "cpu" and ray.cluster_resources().get("GPU", 0) >= 1 else 0
        if self.args.device == "cuda" and not num_gpus:
            raise ValueError("device 'cuda' with --data-parallel-size > 1: the Ray cluster has no GPU")
        return ray.remote(num_cpus=1, num_gpus=num_gpus, max_concurrency=4, max_restarts=0,
                          runtime_env={"env_vars": {"OMP_NUM_THREADS": str(self._num_threads)}})(EngineReplica)

    def _new_replica(self) -> Any:
        return self._actor_class.remote(self.args, self._num_threads)

    # ================================================================ event-loop API

    def stalled_seconds(self) -> Optional[float]:
        """None: the coordinator watches each replica's loop and fails a hung one over
        (--replica-hang-timeout); the cluster as a whole is dead or serving."""
        return None

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

    def replica_num_requests(self) -> list[int]:
        """How many live requests each replica slot holds now (a read from another thread:
        a snapshot, for tests and benchmarks)."""
        counts = [0] * len(self._slots)
        for entry in list(self._dispatched.values()):
            if entry.slot is not None:
                counts[entry.slot] += 1
        return counts

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
        self._dispatched.clear()
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
            _, index, incarnation, report = event
            slot = self._slots[index]
            if slot.incarnation == incarnation and slot.up:  # else from a replica already given up
                try:
                    self._replay(slot, report)
                except Exception as e:  # a report that cannot be read: the replica is not to be trusted
                    logger.exception("replaying replica %d's report failed", index)
                    self._lose(index, incarnation, f"its report could not be read: {e!r}")
        elif kind == "lost":
            self._lose(*event[1:])
        elif kind == "up":
            _, index, incarnation, actor, info = event
            slot = self._slots[index]
            if slot.incarnation == incarnation:
                logger.info("replica %d restarted (pid %d)", index, info.pid)
                self._bring_up(slot, actor, info)
            else:
                _kill(actor)
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
            if self.cluster.ray_address is not None:
                hints = dataclasses.replace(hints, arrival_time=None)  # the replicas' clocks are their own
            elif hints.arrival_time is None:
                hints = dataclasses.replace(hints, arrival_time=self._clock())
            if rid in self._entries:  # (the front refuses a live id; this one's abort is still queued)
                raise ValueError(f"request id {rid!r} is already in use")
            request = Request(rid, prompt_ids, params, hints=hints,
                              arrival_time=self._clock() if hints.arrival_time is None else hints.arrival_time)
        except ValueError as e:
            self.on_accepted(rid, e)
            return
        except Exception as e:
            logger.exception("checking request %s failed", rid)
            self.on_accepted(rid, RequestFailedError(f"adding the request failed: {e!r}"))
            return
        prompt_text = command.prompt if isinstance(command.prompt, str) else command.prompt_text
        self._entries[rid] = _Entry(AddCommand(rid, prompt_ids, params, hints, prompt_text), request,
                                    route_request(request, self._cache_config, self._hasher))
        self._queue.add(request)
        self.on_accepted(rid, None)

    def _abort(self, rid: str) -> None:
        """End a request now, with what its client has; a replica running it is told to stop
        and whatever it still sends for it is dropped."""
        entry = self._entries.get(rid)
        if entry is None:
            return  # finished, or never accepted
        if entry.slot is None:
            self._queue.remove(entry.request)
        else:
            slot = self._slots[entry.slot]
            slot.aborting.add(entry.dispatch_id)
            slot.actor.submit.remote([AbortCommand(entry.dispatch_id)])
        self._end(entry)
        self._deliver(self._final_output(entry, "abort"), self._clock())

    def _end(self, entry: _Entry) -> None:
        """Forget a request: its final output is delivered by the caller."""
        del self._entries[entry.command.request_id]
        if entry.slot is not None:
            del self._dispatched[entry.dispatch_id]
            self._slots[entry.slot].cache.hold(entry.route.block_hashes, -1)
            entry.slot = None

    def _final_output(self, entry: _Entry, reason: str) -> RequestOutput:
        """The final output of a request ended here (aborted, or failed over too often): what its
        client has, finished for `reason`."""
        now = self._clock()
        last = entry.last
        completion = (dataclasses.replace(last.outputs[0], finish_reason=reason, stop_reason=None) if last
                      else CompletionOutput(index=0, text="", token_ids=[], finish_reason=reason))
        metrics = (dataclasses.replace(last.metrics, finished_time=now) if last
                   else RequestMetrics(entry.request.arrival_time, None, None, now, 0, 0))
        return RequestOutput(entry.command.request_id, entry.command.prompt_text, list(entry.command.prompt),
                             [completion], True, metrics)

    def _dispatch(self) -> None:
        dispatch_round(self._queue, self._policy, self._router, self._clock(),
                       lambda: [self._load(s) for s in self._slots if s.up],
                       lambda index: self._has_room(self._slots[index]),
                       lambda request: self._entries[request.request_id].route, self._send_to)

    def _send_to(self, request: Request, index: int) -> None:
        entry, slot = self._entries[request.request_id], self._slots[index]
        entry.slot, entry.dispatch_id = index, f"{entry.command.request_id}#{next(self._dispatch_ids)}"
        self._dispatched[entry.dispatch_id] = entry
        slot.in_transit.add(entry.dispatch_id)
        slot.cache.hold(entry.route.block_hashes, +1)
        slot.actor.submit.remote([dataclasses.replace(entry.command, request_id=entry.dispatch_id,
                                                      resume=self._resume_state(entry))])

    def _has_room(self, slot: _Slot) -> bool:
        return slot.up and slot.num_waiting + len(slot.in_transit) < self.cluster.dispatch_queue_depth

    def _resume_state(self, entry: _Entry) -> Optional[ResumeState]:
        """What the client already has of a request that goes on elsewhere (None: nothing).
        Its times only where the replicas share the coordinator's clock."""
        if entry.last is None or not entry.last.outputs[0].token_ids:
            return None
        completion, metrics = entry.last.outputs[0], entry.last.metrics
        same_clock = self.cluster.ray_address is None
        return ResumeState(
            tuple(completion.token_ids), None if completion.logprobs is None else tuple(completion.logprobs),
            completion.cumulative_logprob or 0.0,
            first_scheduled_time=metrics.first_scheduled_time if same_clock else None,
            first_token_time=metrics.first_token_time if same_clock else None,
            last_token_time=entry.last_output_time if same_clock and metrics.first_token_time is not None else None,
            num_preemptions=metrics.num_preemptions)

    def _load(self, slot: _Slot) -> ReplicaLoad:
        stats = slot.stats
        return ReplicaLoad(slot.index, stats.num_running if stats else 0, slot.num_waiting + len(slot.in_transit),
                           stats.kv_cache_usage if stats else 0.0, slot.info.scheduler_config.max_num_seqs,
                           slot.step_time_s, slot.cache)

    # ---------------------------------------------------------------- replicas' reports

    def _replay(self, slot: _Slot, report: ReplicaReport) -> None:
        """A replica's sink calls, onto the front, in order."""
        slot.step_time_s = report.step_time_s
        if report.cached_blocks is not None:
            slot.cache.reported = report.cached_blocks
        for batch in report.batches:
            for name, call_args in batch:
                getattr(self, f"_replica_{name}")(slot, *call_args)

    def _owned(self, slot: _Slot, dispatch_id: str) -> Optional[_Entry]:
        entry = self._dispatched.get(dispatch_id)
        return entry if entry is not None and entry.slot == slot.index else None

    def _replica_on_accepted(self, slot: _Slot, dispatch_id: str, error: Optional[BaseException]) -> None:
        slot.in_transit.discard(dispatch_id)
        if dispatch_id in slot.aborting and error is None:
            slot.actor.submit.remote([AbortCommand(dispatch_id)])  # it may have overtaken the add
        entry = self._owned(slot, dispatch_id)
        if entry is not None and error is not None:  # a replica refused what the coordinator's checks let through
            self._end(entry)
            self._fail_stream(entry.command.request_id, error)

    def _replica_on_output(self, slot: _Slot, delta: Any, now: float) -> None:
        output = slot.decoder.decode(delta)
        if output.finished:
            slot.aborting.discard(output.request_id)
        entry = self._owned(slot, output.request_id)
        if entry is None:
            return  # ended here already (aborted)
        output = dataclasses.replace(output, request_id=entry.command.request_id)
        entry.last, entry.last_output_time = output, self._clock()
        if output.finished:
            self._end(entry)
        self._deliver(output, entry.last_output_time)  # the front's clock: gaps across replicas are real

    def _replica_on_expired(self, slot: _Slot, delta: Any, message: str) -> None:
        output = slot.decoder.decode(delta)
        slot.aborting.discard(output.request_id)
        entry = self._owned(slot, output.request_id)
        if entry is not None:
            self._end(entry)
            self._expire(dataclasses.replace(output, request_id=entry.command.request_id), message)

    def _replica_on_failed(self, slot: _Slot, dispatch_id: str, error: BaseException) -> None:
        slot.decoder.forget(dispatch_id)
        slot.aborting.discard(dispatch_id)
        entry = self._owned(slot, dispatch_id)
        if entry is not None:
            self._end(entry)
            self._fail_stream(entry.command.request_id, error)

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
        slot = self._slots[index]
        if slot.incarnation != incarnation or not slot.up:
            return
        slot.up = False
        lost = sorted((e for e in self._dispatched.values() if e.slot == index), key=lambda e: e.request.arrival_time)
        logger.error("replica %d lost (%s); its %d requests go back to the global queue", index, why, len(lost))
        if slot.stats is not None:
            self._retired = retire(self._retired, slot.stats)
        _kill(slot.actor)
        for entry in reversed(lost):  # each to the queue's front: the oldest ends up first
            self._end(entry)
            entry.num_failovers += 1
            rid = entry.command.request_id
            if entry.num_failovers > self.cluster.max_request_failovers:
                self._fail_stream(rid, RequestFailedError(
                    f"the request was on {entry.num_failovers} replicas that were lost ({why}); it may be what "
                    "brings them down, so it is not tried again"))
                continue
            self._entries[rid] = entry
            self._queue.push_front(entry.request)
        slot.in_transit.clear()
        slot.aborting.clear()
        slot.decoder.clear()
        slot.cache = CacheView()
        slot.stats, slot.num_waiting, slot.step_time_s = None, 0, 0.0
        self._restart(slot)

    def _restart(self, slot: _Slot) -> None:
        slot.incarnation += 1
        starter = threading.Thread(target=self._start_replica,
                                   args=(slot.index, slot.incarnation, RESTART_BACKOFF_S * slot.failed_starts),
                                   name=f"tokenweir-replica-{slot.index}-start", daemon=True)
        self._starters.append(starter)
        starter.start()

    def _restarting(self) -> bool:
        return any(s.failed_starts <= self.cluster.max_replica_restarts for s in self._slots if not s.up)

    def _start_replica(self, index: int, incarnation: int, delay_s: float) -> None:
        import ray

        if self._stopping.wait(delay_s):
            return
        actor = None
        try:
            actor = self._new_replica()
            info = ray.get(actor.info.remote(), timeout=self.cluster.replica_startup_timeout)
        except Exception as e:
            if actor is not None:
                _kill(actor)
            self._events.put(("start_failed", index, incarnation, repr(e)))
            return
        if self._stopping.is_set():  # shut down meanwhile: nobody will take it
            _kill(actor)
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
                if report.error is None and report.loop_age_s <= hang:
                    continue
                why = report.error or f"its engine loop has been stuck for {report.loop_age_s:.0f} s"
            if not self._stopping.is_set():
                self._events.put(("lost", index, incarnation, why))
            return

    def _stop_replicas(self) -> None:
        import ray

        self._stopping.set()
        live = [s for s in self._slots if s.up]
        for slot in live:
            slot.up = False
        try:  # a replica that does not finish its step within the hang bound is hung: killed below
            ray.get([s.actor.shutdown.remote() for s in live], timeout=self.cluster.replica_hang_timeout)
        except Exception:
            logger.warning("not every replica shut down cleanly; killing them")
        for slot in live:
            _kill(slot.actor)
        for thread in self._pollers + self._starters:
            thread.join(POLL_WAIT_S + 5)
        if self._owns_ray:
            ray.shutdown()


def _kill(actor: Any) -> None:
    import ray

    try:
        ray.kill(actor, no_restart=True)
    except Exception:
        pass  # gone already

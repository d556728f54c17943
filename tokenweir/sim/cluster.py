"""A simulated cluster: N engines behind the cluster's global queue and router, in virtual time.

Each replica is a `Simulator` (the real scheduler, the cost model's step times); between them
sits what the real coordinator runs (cluster/dispatch.py: the global queue in the policy's
order, the router chosen by name, room by `dispatch_queue_depth`), so a simulated routing
decision is the one the coordinator makes. Replicas step concurrently: a step is scheduled when
its replica is free and completes when its predicted time has passed; a request routed to a
replica mid-step, and an abort for one, reach its scheduler between steps, as the real replica's
commands do. Arrivals, client limits and aborts are the single engine's (SimClients).

What is not modelled: the coordinator's and Ray's own latency (a poll round trip), the
replicas' cache reports (the router reads each replica's live cache, plus the prompts routed
there), and failures.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Optional

from tokenweir.cluster.config import ClusterConfig
from tokenweir.cluster.dispatch import CacheView, dispatch_round, mean_step_time, route_request
from tokenweir.cluster.routing import ReplicaLoad, RouteRequest, create_router
from tokenweir.config import EngineArgs
from tokenweir.core.block_hash import BlockHasher
from tokenweir.core.cost_model import StepComposition, StepCostModel
from tokenweir.core.policies import create_policy
from tokenweir.core.scheduler import Scheduler, SchedulerOutput
from tokenweir.request import Request, RequestStatus
from tokenweir.sim.simulator import PROGRESS_EVERY_STEPS, SimClients, SimRequest, SimResult, Simulator
from tokenweir.sim.timeseries import TimeSeries


@dataclass
class _Replica:
    sim: Simulator
    cache: CacheView
    inbox: list[Request] = field(default_factory=list)  # routed here, added at its next step
    aborts: list[str] = field(default_factory=list)  # given up on while it stepped
    step: Optional[tuple[SchedulerOutput, StepComposition]] = None  # in flight, ending at sim.now
    step_time_s: float = 0.0  # the mean of its completed steps, as a real replica reports it


class ClusterSimulator:
    """Runs one workload through `len(replicas)` simulated engines; `run` may be called once."""

    @classmethod
    def from_engine_args(cls, args: EngineArgs, cluster: ClusterConfig, cost_model: StepCostModel,
                         timeseries_points: int = 500) -> ClusterSimulator:
        """`data_parallel_size` engines as `args` describe them, on the profiled device."""
        return cls([Simulator.from_engine_args(args, cost_model) for _ in range(cluster.data_parallel_size)],
                   cluster, timeseries_points)

    def __init__(self, replicas: Sequence[Simulator], cluster: ClusterConfig, timeseries_points: int = 500) -> None:
        if len(replicas) != cluster.data_parallel_size:
            raise ValueError(f"{len(replicas)} simulated engines for a data_parallel_size of {cluster.data_parallel_size}")
        first = replicas[0].scheduler
        self.replicas = [_Replica(r, CacheView(r.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block))
                         for r in replicas]
        self.cluster = cluster
        # The global queue's own policy instance, as the coordinator's.
        self.policy = create_policy(first.config.policy, first.config.policy_config)
        self.queue = self.policy.make_waiting_queue()
        self.router = create_router(cluster.routing_policy, cluster.router)
        self.hasher = BlockHasher(first.cache_config.prefix_cache_hash_key)
        self.routes: dict[str, RouteRequest] = {}
        self.where: dict[str, int] = {}  # request id -> the replica it was routed to
        self.timeseries = TimeSeries(timeseries_points)
        self.now = 0.0

    @property
    def schedulers(self) -> list[Scheduler]:
        return [r.sim.scheduler for r in self.replicas]

    def run(self, requests: Sequence[SimRequest], max_concurrency: Optional[int] = None,
            progress: Callable[[int], None] = lambda done: None) -> SimResult:
        clients = SimClients(requests, max_concurrency, self.schedulers[0].max_model_len, self._enqueue)
        steps_reported = 0
        while clients.num_done < len(requests):
            clients.send_arrived(self.now)
            for rid in clients.take_due_aborts(self.now):
                self._abort(rid, clients)
            for replica in self.replicas:  # those whose step ends now, in replica order
                if replica.step is not None and replica.sim.now <= self.now:
                    out, comp = replica.step
                    replica.step = None
                    replica.step_time_s = mean_step_time(replica.step_time_s, replica.sim.cost_model.predict(comp))
                    replica.sim.complete_step(out, clients.tracks)
                    self._record_step(comp.num_tokens)
                    self._collect(replica, clients, out.finished_req_ids)
            # Until nothing more happens at `now`: starting a step may finish requests (an abort
            # heard between steps, a policy shedding in an empty step), which frees client slots
            # and replica room.
            while True:
                num_done = clients.num_done
                clients.release(self.now)
                self._dispatch()
                for replica in self.replicas:  # free replicas with work start a step now
                    if replica.step is None:
                        self._start_step(replica, clients)
                if clients.num_done == num_done:
                    break
            num_steps = sum(r.sim.num_steps for r in self.replicas)
            if num_steps - steps_reported >= PROGRESS_EVERY_STEPS:
                steps_reported = num_steps
                progress(clients.num_done)
            upcoming = [r.sim.now for r in self.replicas if r.step is not None]
            upcoming += [t for t in (clients.next_event_s(),) if t is not None]
            if not upcoming:
                break
            self.now = max(self.now, min(upcoming))
        return clients.result(progress, sum(r.sim.num_steps for r in self.replicas),
                              sum(s.num_preemptions for s in self.schedulers), self.timeseries)

    # ---------------------------------------------------------------- the coordinator's side

    def _enqueue(self, request: Request, at: float) -> None:
        self.routes[request.request_id] = route_request(request, self.schedulers[0].cache_config, self.hasher)
        self.queue.add(request)

    def _dispatch(self) -> None:
        live = range(len(self.replicas))
        dispatch_round(self.queue, self.policy, self.router, self.now, lambda: [self._load(i) for i in live],
                       self._has_room, lambda request: self.routes[request.request_id], self._send_to)

    def _has_room(self, index: int) -> bool:
        replica = self.replicas[index]
        return len(replica.sim.scheduler.waiting) + len(replica.inbox) < self.cluster.dispatch_queue_depth

    def _load(self, index: int) -> ReplicaLoad:
        replica = self.replicas[index]
        sched = replica.sim.scheduler
        return ReplicaLoad(index, len(sched.running), len(sched.waiting) + len(replica.inbox),
                           sched.kv_cache_manager.get_usage(), sched.config.max_num_seqs, replica.step_time_s,
                           replica.cache)

    def _send_to(self, request: Request, index: int) -> None:
        replica = self.replicas[index]
        replica.inbox.append(request)
        replica.cache.hold(self.routes[request.request_id].block_hashes, +1)
        self.where[request.request_id] = index

    def _abort(self, rid: str, clients: SimClients) -> None:
        """A client gave up: out of the global queue now, or its replica hears of it between steps."""
        index = self.where.get(rid)
        if index is None:
            request = clients.tracks[rid].request
            if request is None or request.is_finished:
                return
            self.queue.remove(request)
            request.status, request.finished_time = RequestStatus.FINISHED_ABORTED, self.now
            self.routes.pop(rid)
            clients.finish(rid, self.now)
            return
        replica = self.replicas[index]
        replica.aborts.append(rid)
        if replica.step is None:
            self._between_steps(replica, clients)

    # ---------------------------------------------------------------- replicas

    def _between_steps(self, replica: _Replica, clients: SimClients) -> None:
        """What reaches a free replica's scheduler, in the order it was sent: the requests
        routed to it, then aborts."""
        sched = replica.sim.scheduler
        replica.sim.now = max(replica.sim.now, self.now)
        for request in replica.inbox:
            sched.add_request(request)
        replica.inbox.clear()
        if replica.aborts:
            aborts, replica.aborts = replica.aborts, []
            sched.abort_requests(aborts, now=self.now)  # those already finished are ignored
            self._collect(replica, clients)

    def _start_step(self, replica: _Replica, clients: SimClients) -> None:
        self._between_steps(replica, clients)
        sim = replica.sim
        if not sim.scheduler.has_unfinished_requests():
            return
        out, comp = sim.schedule_step()
        if comp.num_tokens == 0:
            self._collect(replica, clients, sim.settle_empty_step(out))
            return
        sim.now += sim.cost_model.predict(comp)
        sim.num_steps += 1
        replica.step = (out, comp)

    def _collect(self, replica: _Replica, clients: SimClients, extra: Sequence[str] = ()) -> None:
        """A replica's finished requests end for their clients, and leave its held cache keys."""
        sched = replica.sim.scheduler
        for rid in sorted({*extra, *sched.take_finished_req_ids()}):
            route = self.routes.pop(rid, None)
            if route is not None:
                replica.cache.hold(route.block_hashes, -1)
                del self.where[rid]
            if not clients.tracks[rid].done:
                clients.finish(rid, self.now)

    def _record_step(self, num_tokens: int) -> None:
        """The cluster's time series: totals over the replicas as each step ends."""
        scheds = self.schedulers
        self.timeseries.add(self.now, len(self.queue) + sum(len(s.waiting) for s in scheds)
                            + sum(len(r.inbox) for r in self.replicas),
                            sum(len(s.running) for s in scheds), sum(len(s.swapped) for s in scheds),
                            sum(s.kv_cache_manager.get_usage() for s in scheds) / len(scheds),
                            sum(s.num_preemptions for s in scheds), num_tokens)

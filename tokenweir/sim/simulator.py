"""A discrete-event simulation of one engine: the real scheduler, virtual time, a cost model.

Nothing of the scheduler is re-implemented here. The simulator builds `core.Scheduler` from the
engine's own configs (`EngineArgs.create_engine_configs`, as `EngineCore` does) and drives it
through the calls the engine makes: `add_request` on arrival, `schedule(now)`, then
`update_from_output(out, sampled, now)` once the step's predicted time has passed, and
`abort_requests` when a client gives up. The step's time comes from `StepCostModel.predict` of
the step's composition; the "runner" samples a fixed token for every row that finishes its
prompt, and each request stops at its workload output length (`ignore_eos`), so the scheduler
sees exactly the token counts a real replay of the workload would produce.

Like the engine, a request that arrives during a step is first seen by the next `schedule()`,
and a token is delivered when its step ends. The HTTP path's own delay is not modelled.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Optional

from tokenweir.bench.serve_metrics import RequestRecord
from tokenweir.config import CacheConfig, EngineArgs, SchedulerConfig
from tokenweir.core.cost_model import StepComposition, StepCostModel, step_composition
from tokenweir.core.kv_cache_manager import int8_tokens_per_block
from tokenweir.core.scheduler import Scheduler, SchedulerOutput
from tokenweir.checks import is_finite_number, is_integer
from tokenweir.request import Request, RequestStatus, SamplingParams, SchedulingHints, resolve_max_tokens
from tokenweir.sim.timeseries import TimeSeries

# The token every simulated row samples. Stop conditions never look at it (no EOS, no stop
# ids, ignore_eos), so any id would do.
SAMPLED_TOKEN = 0
# Progress is reported every this many steps.
PROGRESS_EVERY_STEPS = 256


@dataclass(frozen=True, slots=True)
class SimRequest:
    request_id: str
    prompt_token_ids: Sequence[int]
    output_len: int
    arrival_s: float  # when the client sends it (before any client-side concurrency limit)
    hints: SchedulingHints = SchedulingHints()
    # The client aborts the request this long after sending it, if it has not finished.
    abort_after_s: Optional[float] = None

    def __post_init__(self) -> None:
        # Time 0 is the run's start and every latency counts from a send: a negative or NaN
        # time would be measured from the wrong start, or never come.
        if not is_integer(self.output_len) or self.output_len < 1:
            raise ValueError(f"request {self.request_id!r}: output_len must be an integer >= 1, got {self.output_len!r}")
        if not is_finite_number(self.arrival_s) or self.arrival_s < 0:
            raise ValueError(f"request {self.request_id!r}: arrival_s must be a finite number >= 0, got {self.arrival_s!r}")
        if self.abort_after_s is not None and not (is_finite_number(self.abort_after_s) and self.abort_after_s > 0):
            raise ValueError(f"request {self.request_id!r}: abort_after_s must be a finite number > 0 or None, "
                             f"got {self.abort_after_s!r}")


@dataclass
class SimResult:
    records: list[RequestRecord]  # in the order of the requests given
    duration_s: float  # time 0 to the last request's end, as `bench serve` measures it
    num_steps: int
    num_preemptions: int
    timeseries: TimeSeries
    # Filled by whoever holds them: the scheduler stats at the end, for leak checks.
    final_num_free_blocks: int = 0
    num_blocks: int = 0


@dataclass
class _Tracking:
    """Per-request bookkeeping of the client's view: when it sent, and when tokens came."""

    sim: SimRequest
    request: Optional[Request] = None  # the scheduler's live record, once sent
    sent_s: float = 0.0
    first_token_s: Optional[float] = None
    last_token_s: float = 0.0
    num_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    done: bool = False
    end_s: float = 0.0  # when it ended, for the client (last token, abort, rejection)
    refused: Optional[str] = None  # why the server would have answered 400, not served it


def scheduler_configs(args: EngineArgs, model_max_len: int, kv_cache_bytes: int,
                      kv_bytes_per_token: int, int8_block_size: int = 0) -> tuple[CacheConfig, SchedulerConfig]:
    """The configs the engine would build with these args on the profiled device: its KV pool
    is `kv_cache_memory` if given (else the pool the profile was taken with), in blocks, and
    its host tier `swap_space`."""
    per_block = kv_bytes_per_token * args.block_size
    if args.num_gpu_blocks_override is not None:
        num_blocks = args.num_gpu_blocks_override
    else:
        num_blocks = (args.kv_cache_bytes() or kv_cache_bytes) // per_block
    if num_blocks < 1:
        raise ValueError(f"the KV pool holds no block of {per_block} bytes")
    return args.create_engine_configs(model_max_len, num_blocks, num_host_blocks=args.num_host_blocks(per_block),
                                      kv_block_bytes=per_block, int8_block_size=int8_block_size)


def _int8_block_size(args: EngineArgs, meta: dict, kv_bytes_per_token: int) -> int:
    """The tokens an int8 block holds on the profiled engine (0 without int8 K/V). The cost
    model prices an int8 row's attention as a row of the model's dtype."""
    if args.low_priority_kv_cache_dtype != "int8":
        return 0
    head_dim = meta.get("head_dim")
    if not isinstance(head_dim, int) or head_dim < 1 or kv_bytes_per_token % head_dim:
        raise ValueError("simulating low_priority_kv_cache_dtype 'int8' needs the profile's head_dim, which "
                         "profiles taken before int8 K/V do not record; take one with `tokenweir profile`")
    element_size = {"float32": 4, "bfloat16": 2, "float16": 2}.get(meta.get("dtype"), 0)
    if not element_size:
        raise ValueError(f"the profile's dtype {meta.get('dtype')!r} is not one int8 K/V replaces")
    return int8_tokens_per_block(args.block_size, head_dim, element_size)


class SimClients:
    """The clients' side of a run: each request is sent at its arrival (or later, when the
    concurrency limit held it), maybe given up on (`abort_after_s`), and ends when its engine
    reports it finished. `submit(request, at)` hands a sent request to the engine side (one
    scheduler, or a simulated cluster's global queue)."""

    def __init__(self, requests: Sequence[SimRequest], max_concurrency: Optional[int], max_model_len: int,
                 submit: Callable[[Request, float], None]) -> None:
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.tracks = {r.request_id: _Tracking(r) for r in requests}
        if len(self.tracks) != len(requests):
            raise ValueError("simulated request ids must be unique")
        self.requests = requests
        self.max_concurrency = max_concurrency
        self.max_model_len = max_model_len
        self.submit = submit
        # Requests in send order; those over the concurrency limit wait client-side (their
        # latency counts from when they are finally sent, as in `bench serve`).
        self.arrivals = sorted(requests, key=lambda r: r.arrival_s)
        self.next_arrival = 0
        self.held: deque[SimRequest] = deque()  # arrived, waiting for a client slot
        self.in_flight = 0
        self.aborts: list[tuple[float, int, str]] = []  # (time, tie-break, request id), a heap
        self._tie = itertools.count()
        self.num_done = 0

    def send(self, sim: SimRequest, at: float) -> None:
        track = self.tracks[sim.request_id]
        track.sent_s = at
        self.in_flight += 1
        try:  # what the server refuses never reaches its engine
            resolve_max_tokens(len(sim.prompt_token_ids), sim.output_len, self.max_model_len)
        except ValueError as e:
            track.refused = str(e)
            self.finish(sim.request_id, at)
            return
        params = SamplingParams(max_tokens=sim.output_len, temperature=0.0, ignore_eos=True)
        hints = sim.hints
        if hints.arrival_time is None:
            hints = SchedulingHints(**{**hints.to_dict(), "arrival_time": at})
        track.request = Request(sim.request_id, list(sim.prompt_token_ids), params,
                                arrival_time=at, eos_token_id=None, hints=hints)
        self.submit(track.request, at)
        if sim.abort_after_s is not None:
            heapq.heappush(self.aborts, (at + sim.abort_after_s, next(self._tie), sim.request_id))

    def slot_free(self) -> bool:
        return self.max_concurrency is None or self.in_flight < self.max_concurrency

    def finish(self, rid: str, at: float) -> None:
        track = self.tracks[rid]
        if track.sim.abort_after_s is not None:  # a client that gave up ended then
            at = min(at, track.sent_s + track.sim.abort_after_s)
        track.done, track.end_s = True, at
        self.in_flight -= 1
        self.num_done += 1

    def send_arrived(self, now: float) -> None:
        """Requests that arrived by `now`, in order: sent at their arrival if a client slot
        was free then, else held. Called before the slots a step freed are released, so a
        request that arrived while every slot was busy waits for the step's end."""
        while self.next_arrival < len(self.arrivals) and self.arrivals[self.next_arrival].arrival_s <= now:
            sim = self.arrivals[self.next_arrival]
            self.next_arrival += 1
            if self.held or not self.slot_free():
                self.held.append(sim)
            else:
                self.send(sim, sim.arrival_s)

    def release(self, now: float) -> None:
        """Held requests, sent as client slots free up."""
        while self.held and self.slot_free():
            self.send(self.held.popleft(), now)

    def take_due_aborts(self, now: float) -> list[str]:
        """The requests whose clients have given up by `now`, in time order."""
        due = []
        while self.aborts and self.aborts[0][0] <= now:
            due.append(heapq.heappop(self.aborts)[2])
        return due

    def next_event_s(self) -> Optional[float]:
        """When the next request arrives or client gives up (None: neither ever)."""
        upcoming = [t for t in (self.arrivals[self.next_arrival].arrival_s if self.next_arrival < len(self.arrivals)
                                else None, self.aborts[0][0] if self.aborts else None) if t is not None]
        return min(upcoming) if upcoming else None

    def result(self, progress: Callable[[int], None], num_steps: int, num_preemptions: int,
               timeseries: TimeSeries) -> SimResult:
        progress(self.num_done)
        if self.num_done < len(self.requests):
            raise RuntimeError(f"simulation stopped with {len(self.requests) - self.num_done} requests unfinished")
        records = [_record(self.tracks[r.request_id]) for r in self.requests]
        # As `bench serve` measures it: from the start (time 0) until the last request ends.
        end = max((t.end_s for t in self.tracks.values()), default=0.0)
        return SimResult(records, max(end, 1e-9), num_steps, num_preemptions, timeseries)


class Simulator:
    """Runs one workload through one simulated engine; `run` may be called once."""

    @classmethod
    def from_engine_args(cls, args: EngineArgs, cost_model: StepCostModel, timeseries_points: int = 500,
                         on_step: Optional[Callable[[SchedulerOutput, float], None]] = None) -> Simulator:
        """The engine `args` describe, on the device and model the profile was taken on."""
        meta = cost_model.metadata
        try:
            model_max_len, kv_cache_bytes, per_block, block_size = (
                int(meta[k]) for k in ("max_model_len", "kv_cache_bytes", "kv_bytes_per_block", "block_size"))
            if min(model_max_len, kv_cache_bytes, per_block, block_size) < 1:
                raise ValueError
            per_token = per_block // block_size
        except (KeyError, TypeError, ValueError):
            raise ValueError("the cost profile's metadata lacks the model's max_model_len, "
                             "kv_cache_bytes, kv_bytes_per_block or block_size (positive integers); "
                             "take it with `tokenweir profile`") from None
        cache_cfg, sched_cfg = scheduler_configs(args, model_max_len, kv_cache_bytes, per_token,
                                                 _int8_block_size(args, meta, per_token))
        # `auto` preemption decides by this very model, so a simulated choice is the engine's.
        return cls(Scheduler(sched_cfg, cache_cfg, cost_model=cost_model), cost_model, per_token * args.block_size,
                   timeseries_points, on_step)

    def __init__(self, scheduler: Scheduler, cost_model: StepCostModel, kv_bytes_per_block: int,
                 timeseries_points: int = 500,
                 on_step: Optional[Callable[[SchedulerOutput, float], None]] = None) -> None:
        self.scheduler = scheduler
        # Sees every step as scheduled, with its start time (tests compare decisions with it).
        self.on_step = on_step
        self.cost_model = cost_model
        self.kv_bytes_per_block = kv_bytes_per_block
        self.timeseries = TimeSeries(timeseries_points)
        self.now = 0.0
        self.num_steps = 0

    def run(self, requests: Sequence[SimRequest], max_concurrency: Optional[int] = None,
            progress: Callable[[int], None] = lambda done: None) -> SimResult:
        sched = self.scheduler
        clients = SimClients(requests, max_concurrency, sched.max_model_len,
                             lambda request, at: sched.add_request(request))
        while clients.num_done < len(requests):
            # Everything that happened by `now`: sends and client aborts, in time order.
            clients.send_arrived(self.now)
            for rid in clients.take_due_aborts(self.now):
                sched.abort_requests([rid], now=self.now)  # ignored if it has just finished
            self.collect_finished(clients)
            if not sched.has_unfinished_requests():
                # Idle until the next event (nothing is held: with nothing in flight, every
                # slot is free).
                upcoming = clients.next_event_s()
                if upcoming is None:
                    break
                self.now = max(self.now, upcoming)
                continue
            reported = self._step(clients.tracks)
            clients.send_arrived(self.now)
            self.collect_finished(clients, reported)
            if self.num_steps % PROGRESS_EVERY_STEPS == 0:
                progress(clients.num_done)
        return clients.result(progress, self.num_steps, sched.get_stats().num_preemptions, self.timeseries)

    def collect_finished(self, clients: SimClients, extra: Iterable[str] = ()) -> None:
        """Every way an admitted request ends (its length, an abort, a policy that sheds
        it) passes through the scheduler's finished ids: those `schedule()` reported in
        its output (`extra`) and those finished since. Freed client slots then send held
        requests at once."""
        for rid in sorted({*extra, *self.scheduler.take_finished_req_ids()}):  # a set's order is not stable
            if not clients.tracks[rid].done:
                clients.finish(rid, self.now)
        clients.release(self.now)

    def _step(self, tracks: dict[str, _Tracking]) -> set[str]:
        """One engine step; returns the finished ids `schedule()` reported."""
        out, comp = self.schedule_step()
        if comp.num_tokens == 0:
            return self.settle_empty_step(out)
        self.now += self.cost_model.predict(comp)
        self.num_steps += 1
        self.complete_step(out, tracks)
        sched = self.scheduler
        # The counts themselves, not get_stats(): that also copies the prefix-cache and policy
        # stats, every step.
        self.timeseries.add(self.now, len(sched.waiting), len(sched.running), len(sched.swapped),
                            sched.kv_cache_manager.get_usage(), sched.num_preemptions, comp.num_tokens)
        return out.finished_req_ids

    # A step in two halves, for a caller that interleaves several engines' steps in time (the
    # simulated cluster): scheduled at `now`, completed once its predicted time has passed.

    def schedule_step(self) -> tuple[SchedulerOutput, StepComposition]:
        out = self.scheduler.schedule(now=self.now)
        if self.on_step is not None:
            self.on_step(out, self.now)
        return out, step_composition(out, self.scheduler.requests, self.kv_bytes_per_block)

    def settle_empty_step(self, out: SchedulerOutput) -> set[str]:
        """A step that schedules nothing: the policy shed every request left (their ids are
        returned), or the engine is stalled (an error)."""
        sched = self.scheduler
        sched.update_from_output(out, {}, self.now)  # settle the empty step
        if not sched.has_unfinished_requests():
            return out.finished_req_ids
        # Requests are unfinished but none can run (a prompt that needs more blocks than the
        # pool can ever free, say): the real engine would spin here for good.
        raise RuntimeError(f"simulated engine stalled at t={self.now:.3f}s: "
                           f"{len(sched.waiting)} waiting, {len(sched.running)} running, nothing schedulable")

    def complete_step(self, out: SchedulerOutput, tracks: dict[str, _Tracking]) -> None:
        """The step's tokens, at `now` (its end): every row that finished its prompt samples."""
        sched = self.scheduler
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            r = sched.requests[rid]
            if r.num_computed_tokens + n >= r.num_tokens:
                sampled[rid] = [SAMPLED_TOKEN]
        for update in sched.update_from_output(out, sampled, self.now):
            track = tracks[update.request.request_id]
            gave_up = track.sim.abort_after_s is not None and self.now > track.sent_s + track.sim.abort_after_s
            # A client that has given up receives nothing more, though the engine hears of
            # the abort only after the step.
            if update.new_token_ids and not gave_up:
                if track.first_token_s is None:
                    track.first_token_s = self.now
                else:
                    track.itl.append(self.now - track.last_token_s)
                track.last_token_s = self.now
                track.num_tokens += len(update.new_token_ids)

def _record(track: _Tracking) -> RequestRecord:
    request = track.request
    prompt_len = len(track.sim.prompt_token_ids)
    if track.refused is not None:
        return RequestRecord(success=False, prompt_len=prompt_len, output_tokens=0, error=track.refused)
    if request.status not in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED):
        reason = request.status_message or request.status.name.lower()
        return RequestRecord(success=False, prompt_len=prompt_len,
                             output_tokens=track.num_tokens, error=reason)
    if track.num_tokens < track.sim.output_len:
        # It finished in a step that ended after its client gave up: the engine hears of
        # the abort only then, the client never heard its last tokens.
        return RequestRecord(success=False, prompt_len=prompt_len, output_tokens=track.num_tokens,
                             error="aborted by the client before its last token")
    return RequestRecord(success=True, prompt_len=prompt_len, output_tokens=track.num_tokens,
                         ttft=track.first_token_s - track.sent_s,
                         latency=track.last_token_s - track.sent_s, itl=track.itl)

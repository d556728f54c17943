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
from tokenweir.core.cost_model import StepCostModel, step_composition
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
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        tracks = {r.request_id: _Tracking(r) for r in requests}
        if len(tracks) != len(requests):
            raise ValueError("simulated request ids must be unique")
        # Clients: requests in send order; those over the concurrency limit wait client-side
        # (their latency counts from when they are finally sent, as in `bench serve`).
        arrivals = sorted(requests, key=lambda r: r.arrival_s)
        next_arrival = 0
        held: deque[SimRequest] = deque()  # arrived, waiting for a client slot
        in_flight = 0
        aborts: list[tuple[float, int, str]] = []  # (time, tie-break, request id), a heap
        tie = itertools.count()
        sched = self.scheduler
        num_done = 0

        def send(sim: SimRequest, at: float) -> None:
            nonlocal in_flight
            track = tracks[sim.request_id]
            track.sent_s = at
            in_flight += 1
            try:  # what the server refuses never reaches its engine
                resolve_max_tokens(len(sim.prompt_token_ids), sim.output_len, sched.max_model_len)
            except ValueError as e:
                track.refused = str(e)
                finish(sim.request_id, at)
                return
            params = SamplingParams(max_tokens=sim.output_len, temperature=0.0, ignore_eos=True)
            hints = sim.hints
            if hints.arrival_time is None:
                hints = SchedulingHints(**{**hints.to_dict(), "arrival_time": at})
            track.request = Request(sim.request_id, list(sim.prompt_token_ids), params,
                                    arrival_time=at, eos_token_id=None, hints=hints)
            sched.add_request(track.request)
            if sim.abort_after_s is not None:
                heapq.heappush(aborts, (at + sim.abort_after_s, next(tie), sim.request_id))

        def slot_free() -> bool:
            return max_concurrency is None or in_flight < max_concurrency

        def finish(rid: str, at: float) -> None:
            nonlocal in_flight, num_done
            track = tracks[rid]
            if track.sim.abort_after_s is not None:  # a client that gave up ended then
                at = min(at, track.sent_s + track.sim.abort_after_s)
            track.done, track.end_s = True, at
            in_flight -= 1
            num_done += 1

        def send_arrived() -> None:
            """Requests that arrived by `now`, in order: sent at their arrival if a client slot
            was free then, else held. Called before the slots a step freed are released, so a
            request that arrived while every slot was busy waits for the step's end."""
            nonlocal next_arrival
            while next_arrival < len(arrivals) and arrivals[next_arrival].arrival_s <= self.now:
                sim = arrivals[next_arrival]
                next_arrival += 1
                if held or not slot_free():
                    held.append(sim)
                else:
                    send(sim, sim.arrival_s)

        def collect_finished(extra: Iterable[str] = ()) -> None:
            """Every way an admitted request ends (its length, an abort, a policy that sheds
            it) passes through the scheduler's finished ids: those `schedule()` reported in
            its output (`extra`) and those finished since. Freed client slots then send held
            requests at once."""
            for rid in sorted({*extra, *sched.take_finished_req_ids()}):  # a set's order is not stable
                if not tracks[rid].done:
                    finish(rid, self.now)
            while held and slot_free():
                send(held.popleft(), self.now)

        while num_done < len(requests):
            # Everything that happened by `now`: sends and client aborts, in time order.
            send_arrived()
            while aborts and aborts[0][0] <= self.now:
                _, _, rid = heapq.heappop(aborts)
                sched.abort_requests([rid], now=self.now)  # ignored if it has just finished
            collect_finished()
            if not sched.has_unfinished_requests():
                # Idle until the next event (nothing is held: with nothing in flight, every
                # slot is free).
                upcoming = [t for t in (arrivals[next_arrival].arrival_s if next_arrival < len(arrivals) else None,
                                        aborts[0][0] if aborts else None) if t is not None]
                if not upcoming:
                    break
                self.now = max(self.now, min(upcoming))
                continue
            reported = self._step(tracks)
            send_arrived()
            collect_finished(reported)
            if self.num_steps % PROGRESS_EVERY_STEPS == 0:
                progress(num_done)
        progress(num_done)
        if num_done < len(requests):
            raise RuntimeError(f"simulation stopped with {len(requests) - num_done} requests unfinished")

        records = [self._record(tracks[r.request_id]) for r in requests]
        # As `bench serve` measures it: from the start (time 0) until the last request ends.
        end = max((t.end_s for t in tracks.values()), default=0.0)
        return SimResult(records, max(end, 1e-9), self.num_steps,
                         sched.get_stats().num_preemptions, self.timeseries)

    def _step(self, tracks: dict[str, _Tracking]) -> set[str]:
        """One engine step; returns the finished ids `schedule()` reported."""
        sched = self.scheduler
        out = sched.schedule(now=self.now)
        if self.on_step is not None:
            self.on_step(out, self.now)
        comp = step_composition(out, sched.requests, self.kv_bytes_per_block)
        if comp.num_tokens == 0:
            sched.update_from_output(out, {}, self.now)  # settle the empty step
            if not sched.has_unfinished_requests():
                return out.finished_req_ids  # the policy shed everything that was left
            # Requests are unfinished but none can run (a prompt that needs more blocks than the
            # pool can ever free, say): the real engine would spin here for good.
            raise RuntimeError(f"simulated engine stalled at t={self.now:.3f}s: "
                               f"{len(sched.waiting)} waiting, {len(sched.running)} running, nothing schedulable")
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            r = sched.requests[rid]
            if r.num_computed_tokens + n >= r.num_tokens:
                sampled[rid] = [SAMPLED_TOKEN]
        self.now += self.cost_model.predict(comp)
        self.num_steps += 1
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
        # The counts themselves, not get_stats(): that also copies the prefix-cache and policy
        # stats, every step.
        self.timeseries.add(self.now, len(sched.waiting), len(sched.running), len(sched.swapped),
                            sched.kv_cache_manager.get_usage(), sched.num_preemptions, comp.num_tokens)
        return out.finished_req_ids

    @staticmethod
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

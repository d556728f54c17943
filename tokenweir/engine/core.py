"""EngineCore: the model, the scheduler and the runner; one step = schedule -> execute -> update.

A step is all-or-nothing for the requests in it: if anything in it raises, exactly the requests
it scheduled fail (aborted in the scheduler, so their blocks come back; dropped from the runner
and the output processor); every other request goes on. `step()` returns everything the step
produced in one `StepResult`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Union

import torch

from tokenweir.config import EngineArgs
from tokenweir.core.cost_model import StepCostModel, load_cost_model
from tokenweir.core.kv_cache_manager import int8_tokens_per_block
from tokenweir.core.scheduler import Scheduler, SchedulerOutput, SchedulerStats
from tokenweir.engine.cpu_allocator import keep_freed_memory
from tokenweir.engine.output import OutputProcessor, OutputState, RequestOutput
from tokenweir.machine import cpu_name
from tokenweir.model.arch import kv_cache_bytes_per_block
from tokenweir.model.loader import LoadedModel, load_model, sampling_defaults
from tokenweir.model.runner import ModelRunner
from tokenweir.engine.request_checks import check_prompt, check_resume, checked_params, tokenize
from tokenweir.request import Request, ResumeState, SamplingParams, SchedulingHints

logger = logging.getLogger("tokenweir")

DEFAULT_CPU_KV_CACHE_BYTES = 2 * 1024**3


def _num_kv_blocks(args: EngineArgs, loaded: LoadedModel) -> int:
    if args.num_gpu_blocks_override is not None:
        return args.num_gpu_blocks_override
    per_block = kv_cache_bytes_per_block(loaded.arch, args.block_size, loaded.dtype)
    budget = args.kv_cache_bytes()
    if budget is None and loaded.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(loaded.device)
        # Leave (1 - utilization) of the card and 1 GiB of activations to everything else.
        budget = max(0, int(free - (1 - args.gpu_memory_utilization) * total) - 1024**3)
    if budget is None:
        budget = DEFAULT_CPU_KV_CACHE_BYTES
    num_blocks = budget // per_block
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory of {budget} bytes holds no block of {per_block} bytes")
    return num_blocks


@dataclass
class StepResult:
    """What one engine step produced."""

    outputs: list[RequestOutput]  # requests that gained tokens or finished in this step
    # Requests that failed in this step, with the error: already aborted (blocks freed) and
    # left out of `outputs`; the caller reports the errors.
    failed: dict[str, BaseException]
    scheduler_output: SchedulerOutput  # what the step scheduled (its iteration stats)
    # Requests the scheduler's policy gave up on while scheduling (deadline passed or unmeetable), with why:
    # finished (aborted, blocks freed), their final outputs are in `outputs`.
    expired: dict[str, str] = field(default_factory=dict)


class EngineCore:
    def __init__(self, args: EngineArgs, loaded: Optional[LoadedModel] = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.args = args
        # The engine's clock: every `now` the scheduler sees, arrival times and output metrics.
        # Monotonic, so intervals stay true when the wall clock is set.
        self.clock = clock
        self.loaded = loaded or load_model(args.model, args.dtype, args.device)
        if self.loaded.device.type == "cpu":
            keep_freed_memory()
        self.tokenizer = self.loaded.tokenizer
        arch = self.loaded.arch
        num_blocks = _num_kv_blocks(args, self.loaded)
        self.kv_bytes_per_block = per_block = kv_cache_bytes_per_block(arch, args.block_size, self.loaded.dtype)
        num_host_blocks = args.num_host_blocks(per_block)
        int8_block_size = (int8_tokens_per_block(args.block_size, arch.head_dim, self.loaded.dtype.itemsize)
                           if args.low_priority_kv_cache_dtype == "int8" else 0)
        if int8_block_size and int8_block_size <= args.block_size:
            raise ValueError(f"low_priority_kv_cache_dtype 'int8': an int8 block of {args.block_size} "
                             f"{self.loaded.dtype} tokens' bytes holds {int8_block_size} int8 tokens with their "
                             "scales, no more than it holds now; use a larger block_size")
        self.cache_config, self.scheduler_config = args.create_engine_configs(
            arch.max_model_len, num_blocks, num_host_blocks=num_host_blocks, kv_block_bytes=per_block,
            int8_block_size=int8_block_size)
        self.served_model_name = args.served_model_name or self.loaded.name
        self.runner = ModelRunner(self.loaded, num_blocks, args.block_size, args.seed, num_host_blocks,
                                  int8_block_size=int8_block_size)
        self.scheduler = Scheduler(self.scheduler_config, self.cache_config, cost_model=self._cost_model())
        # The longest request (prompt + output): the scheduler's limit, which also counts the
        # KV pool and, without chunked prefill, the step budget. Everyone reads it from here.
        self.max_model_len = self.scheduler.max_model_len
        self.output_processor = OutputProcessor(self.tokenizer)
        self.states: dict[str, OutputState] = {}
        num_tokens = num_blocks * args.block_size
        logger.info("model %s (%s, %s on %s)", self.served_model_name, self.loaded.path,
                    str(self.loaded.dtype).removeprefix("torch."), self.loaded.device)
        # What a request that leaves these unset gets (LLM.generate without params, the
        # server's bodies), as vLLM's --generation-config auto does.
        self.default_sampling_params = (sampling_defaults(Path(self.loaded.path)) if args.generation_config == "auto"
                                        else {})
        if self.default_sampling_params:
            logger.info("default sampling parameters from the model's generation_config.json (--generation-config "
                        "vllm ignores them): %s", self.default_sampling_params)
        logger.info("KV cache: %d blocks of %d tokens = %d tokens; maximum concurrency for %d tokens "
                    "per request: %.2fx", num_blocks, args.block_size, num_tokens, self.max_model_len,
                    num_tokens / self.max_model_len)
        if int8_block_size:
            logger.info("int8 K/V for requests of priority >= %d: %d tokens per block (%d in %s)",
                        self.cache_config.int8_kv_min_priority, int8_block_size, args.block_size,
                        str(self.loaded.dtype).removeprefix("torch."))

    def describe(self) -> dict:
        """What a cost profile records about the engine it measured (and the simulator sizes its
        KV pool and limits from): model, dtype, device, threads, block size and the KV pool."""
        device = self.loaded.device
        return {
            "model": self.served_model_name,
            "model_path": str(self.loaded.path),  # its tokenizer, for exact prompt lengths
            "dtype": str(self.loaded.dtype).removeprefix("torch."),
            "device": str(device),
            "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                            else cpu_name()),
            "torch_threads": torch.get_num_threads(),
            "max_model_len": self.loaded.arch.max_model_len,
            "head_dim": self.loaded.arch.head_dim,  # the tokens an int8 block holds depend on it
            "block_size": self.cache_config.block_size,
            "kv_bytes_per_block": self.kv_bytes_per_block,
            "kv_cache_bytes": self.cache_config.num_blocks * self.kv_bytes_per_block,
        }

    def _cost_model(self) -> Optional[StepCostModel]:
        """For `auto` preemption: the shipped step-cost profile, its swap term replaced by the
        copy bandwidth measured here, on this device's own caches, before any request runs."""
        host = self.runner.host_kv_cache
        if self.cache_config.preemption_mode != "auto" or host is None:
            return None
        bandwidth = host.measure_bandwidth(self.runner.kv_caches)
        logger.info("swap space: %d blocks (%.2f GiB); measured copy bandwidth %.2f GB/s",
                    host.num_blocks, self.args.swap_space, bandwidth / 1e9)
        return dataclasses.replace(load_cost_model(None), swap_bytes_per_second=bandwidth)

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt: Union[str, list[int]], params: SamplingParams,
                    hints: SchedulingHints = SchedulingHints(), *,
                    prompt_text: Optional[str] = None, resume: Optional[ResumeState] = None) -> Request:
        """Validate and queue a request; raises ValueError with a precise message on bad input.
        `resume`: the outputs a client already has of it from another engine (failover), which
        it continues from.

        Atomic: everything that can fail (checks, tokenization, the output state) happens before
        the scheduler sees the request, so a raise leaves nothing behind.
        """
        if request_id in self.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        vocab = self.loaded.arch.vocab_size
        params = checked_params(params, hints, vocab)
        prompt_token_ids = tokenize(self.tokenizer, prompt)
        check_prompt(prompt_token_ids, vocab, self.max_model_len)
        check_resume(resume, params, vocab)
        request = Request(request_id=request_id, prompt_token_ids=prompt_token_ids,
                          sampling_params=self._with_eos_stop_ids(params),
                          arrival_time=self.clock() if hints.arrival_time is None else hints.arrival_time,
                          eos_token_id=self.loaded.arch.eos_token_id, hints=hints)
        if resume is not None:
            request.restore(resume)
        state = self.output_processor.new_state(request, prompt if isinstance(prompt, str) else prompt_text)
        if resume is not None:
            self.output_processor.restore_state(state, resume)
        self.scheduler.add_request(request)  # queues it or raises, nothing in between
        self.states[request_id] = state
        return request

    def _with_eos_stop_ids(self, params: SamplingParams) -> SamplingParams:
        """`params` with every EOS id of the model among its stop ids, unless it ignores EOS.

        The one place where the model's EOS ids become stop conditions: the scheduler stops on
        the stop ids and the sampler masks them below min_tokens. Models such as Llama 3
        Instruct end a turn with more than one token (generation_config adds EOS ids); as in
        vLLM those report the id as stop_reason, while `Request.eos_token_id`, the primary EOS,
        is checked first and reports none.
        """
        if params.ignore_eos:
            return params
        extra = [t for t in self.loaded.arch.eos_token_ids if t not in params.stop_token_ids]
        if not extra:
            return params
        # Set after construction: the user's list was checked against its bound, the model's
        # EOS ids must not count toward it. `params` is add_request's own copy.
        params.stop_token_ids = params.stop_token_ids + extra
        return params

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        """Abort and return the final (aborted) outputs of those that were still unfinished."""
        self.scheduler.abort_requests(request_ids, now=self.clock())
        outputs = []
        for rid in request_ids:
            state = self.states.pop(rid, None)
            if state is not None:
                outputs.append(self.output_processor.make_output(state))
        self._release_if_idle()
        return outputs

    def _release_if_idle(self) -> None:
        """The runner hears of finished requests in the next step's SchedulerOutput; with nothing
        left to run there is no next step, so tell it now: an idle engine holds no finished
        request's state or seeded generator."""
        if not self.scheduler.has_unfinished_requests() and self.scheduler.step_in_flight is None:
            self.runner.drop_requests(self.scheduler.take_finished_req_ids())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def num_waiting_requests(self) -> int:
        return len(self.scheduler.waiting)

    # ------------------------------------------------------------------ the step

    def step(self) -> StepResult:
        return self.execute(self.schedule())

    # A caller that must act once a step has scheduled and before the model runs (the async
    # engine publishes its waiting count there) calls the two phases itself: no callback slot
    # that a second user could overwrite. If it cannot go on to `execute`, it must hand the
    # scheduled step to `fail_step`, or the step's requests would stay scheduled for good.

    def schedule(self) -> SchedulerOutput:
        """Phase 1: decide the step (the scheduler allocates its blocks)."""
        return self.scheduler.schedule(now=self.clock())

    def execute(self, scheduled: SchedulerOutput) -> StepResult:
        """Phase 2: run the model on a scheduled step and update every layer from the result.

        Never raises for a failure inside the step (an interrupt is re-raised once the step is
        undone): the failure fails the step's requests (see `fail_step`). A failure in one
        request's output processing fails that request only.
        """
        failed: dict[str, BaseException] = {}
        expired = self._take_expired(scheduled)
        try:
            runner_output = self.runner.execute_model(scheduled)
            now = self.clock()
            updates = self.scheduler.update_from_output(scheduled, runner_output.sampled_token_ids, now)
            processed = self.output_processor.process_step(
                (self.states[u.request.request_id], len(u.new_token_ids),
                 runner_output.logprobs.get(u.request.request_id)) for u in updates)
            for status in set(processed.finished.values()):
                self.scheduler.finish_requests(
                    [rid for rid, s in processed.finished.items() if s == status], status, now)
            failed = self._fail(processed.failed)
            result = StepResult([], failed, scheduled, {rid: message for rid, (message, _) in expired.items()})
            result.outputs.extend(output for _, output in expired.values())
            finished = []
            for update in updates:
                state = self.states.get(update.request.request_id)
                if state is not None:  # else it failed above
                    result.outputs.append(self.output_processor.make_output(state))
                    if update.request.is_finished:
                        finished.append(update.request.request_id)
            # Only once every output exists: a raise above must still find every state to fail.
            for rid in finished:
                del self.states[rid]
            self._release_if_idle()
            return result
        except BaseException as e:
            logger.exception("engine step failed; failing its %d requests", len(scheduled.num_scheduled_tokens))
            result = self.fail_step(scheduled, e)
            result.failed = {**failed, **result.failed}  # requests failed before the raise, too
            result.expired = {rid: message for rid, (message, _) in expired.items()}
            result.outputs.extend(output for _, output in expired.values())
            self._release_if_idle()
            if not isinstance(e, Exception):
                raise  # KeyboardInterrupt and the like: undone, but not swallowed
            return result

    def _take_expired(self, scheduled: SchedulerOutput) -> dict[str, tuple[str, RequestOutput]]:
        """The requests the scheduler finished while scheduling this step (a policy shedding
        expired ones): finished ids whose output state the engine still holds. Their final
        outputs, and why, and their state dropped."""
        expired = {}
        for rid in scheduled.finished_req_ids:
            state = self.states.get(rid)
            if state is not None and state.request.is_finished:
                del self.states[rid]
                expired[rid] = (state.request.status_message or "finished by the scheduler",
                                self.output_processor.make_output(state))
        return expired

    def fail_step(self, scheduled: SchedulerOutput, error: BaseException) -> StepResult:
        """Fail every request `scheduled` holds: a step that raised, or one its caller could not
        run. The runner also drops the step's finished and preempted ids, which it would have
        been told while running it, so no state and no seeded generator outlives its request."""
        preempted = scheduled.preempted_req_ids - scheduled.num_scheduled_tokens.keys()
        self.runner.drop_requests(scheduled.finished_req_ids)
        self.runner.drop_requests(preempted, keep_generators=True)
        if self.scheduler.step_in_flight == scheduled.step_id:
            # Settles the step: its still-live requests are aborted (blocks freed), and none that
            # update_from_output had finished stays among the running ones.
            self.scheduler.fail_step(scheduled, self.clock())
        return StepResult([], self._fail({rid: error for rid in scheduled.num_scheduled_tokens}), scheduled)

    def _fail(self, errors: dict[str, BaseException]) -> dict[str, BaseException]:
        """Abort these requests and drop their runner and output state; returns those that were
        still live (a request the step had already finished has no state left to fail)."""
        if errors:
            # The abort frees their blocks (finished ids are ignored) and reports them to the
            # runner as finished in the next step; the runner drops them now already.
            self.scheduler.abort_requests(list(errors), self.clock())
            self.runner.drop_requests(errors)
        return {rid: e for rid, e in errors.items() if self.states.pop(rid, None) is not None}

    def get_stats(self) -> SchedulerStats:
        # Now, for the policy's explanation of the longest-waiting requests (SchedulerStats.longest_waiting).
        return self.scheduler.get_stats(self.clock())

    def explain_request(self, request_id: str) -> Optional[dict[str, object]]:
        """The policy's rank terms of an unfinished request now (Scheduler.explain_request:
        KeyError for an id not unfinished, None under a policy without scores). From the thread
        that steps the engine."""
        return self.scheduler.explain_request(request_id, self.clock())

    def reset_prefix_cache(self) -> None:
        self.scheduler.reset_prefix_cache()

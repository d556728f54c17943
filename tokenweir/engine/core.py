"""EngineCore: the model, the scheduler and the runner; one step = schedule -> execute -> update."""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Optional, Union

import torch

from tokenweir.checks import is_integer
from tokenweir.config import EngineArgs
from tokenweir.core.scheduler import Scheduler, SchedulerOutput, SchedulerStats
from tokenweir.engine.cpu_allocator import keep_freed_memory
from tokenweir.engine.output import OutputProcessor, OutputState, RequestOutput
from tokenweir.model.arch import kv_cache_bytes_per_block
from tokenweir.model.loader import LoadedModel, load_model
from tokenweir.model.runner import ModelRunner
from tokenweir.request import Request, RequestStatus, SamplingParams, SchedulingHints

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


class EngineCore:
    def __init__(self, args: EngineArgs, loaded: Optional[LoadedModel] = None) -> None:
        self.args = args
        self.loaded = loaded or load_model(args.model, args.dtype, args.device)
        if self.loaded.device.type == "cpu":
            keep_freed_memory()
        self.tokenizer = self.loaded.tokenizer
        arch = self.loaded.arch
        # Models such as Llama 3 Instruct end a turn with more than one token: the ids that
        # generation_config adds to the primary EOS stop requests as stop token ids (as in vLLM).
        self._extra_eos_ids = [t for t in arch.eos_token_ids if t != arch.eos_token_id]
        num_blocks = _num_kv_blocks(args, self.loaded)
        self.cache_config, self.scheduler_config = args.create_engine_configs(
            arch.max_model_len, num_blocks)
        self.max_model_len = self.scheduler_config.max_model_len
        self.served_model_name = args.served_model_name or self.loaded.name
        self.scheduler = Scheduler(self.scheduler_config, self.cache_config)
        self.runner = ModelRunner(self.loaded, num_blocks, args.block_size, args.seed)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.states: dict[str, OutputState] = {}
        self.last_scheduler_output: Optional[SchedulerOutput] = None  # for metrics and checks
        # Called once a step has scheduled, before the model runs (which may take seconds): the
        # async front publishes its waiting count from here.
        self.on_scheduled: Optional[Callable[[SchedulerOutput], None]] = None
        self._failed: dict[str, Exception] = {}
        num_tokens = num_blocks * args.block_size
        logger.info("model %s (%s, %s on %s)", self.served_model_name, self.loaded.path,
                    str(self.loaded.dtype).removeprefix("torch."), self.loaded.device)
        logger.info("KV cache: %d blocks of %d tokens = %d tokens; maximum concurrency for %d tokens "
                    "per request: %.2fx", num_blocks, args.block_size, num_tokens, self.max_model_len,
                    num_tokens / self.max_model_len)

    # ------------------------------------------------------------------ requests

    def tokenize(self, prompt: Union[str, list[int]]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: it must contain at least one token")
        if len(prompt_token_ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(prompt_token_ids)} tokens, more than "
                             f"max_model_len ({self.max_model_len})")
        vocab = self.loaded.arch.vocab_size
        bad = [t for t in prompt_token_ids if not is_integer(t) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}")

    def add_request(self, request_id: str, prompt: Union[str, list[int]], params: SamplingParams,
                    hints: SchedulingHints = SchedulingHints(), *,
                    prompt_text: Optional[str] = None) -> Request:
        """Validate and queue a request; raises ValueError with a precise message on bad input."""
        if request_id in self.states:
            raise ValueError(f"request id {request_id!r} is already in use")
        if not isinstance(hints, SchedulingHints):
            raise ValueError(f"hints must be SchedulingHints, got {type(hints).__name__}")
        prompt_token_ids = self.tokenize(prompt)
        self.validate_prompt(prompt_token_ids)
        vocab = self.loaded.arch.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids below the vocabulary size ({vocab}), "
                             f"got {params.stop_token_ids}")
        params = self._with_extra_eos(params)
        request = Request(request_id=request_id, prompt_token_ids=prompt_token_ids, sampling_params=params,
                          arrival_time=time.time() if hints.arrival_time is None else hints.arrival_time,
                          eos_token_id=self.loaded.arch.eos_token_id, hints=hints)
        self.scheduler.add_request(request)
        if request.status == RequestStatus.FINISHED_IGNORED:
            raise ValueError(request.status_message)
        self.states[request_id] = self.output_processor.new_state(
            request, prompt if isinstance(prompt, str) else prompt_text)
        return request

    def _with_extra_eos(self, params: SamplingParams) -> SamplingParams:
        """`params` with the model's extra EOS ids among its stop ids, unless it ignores EOS."""
        if not self._extra_eos_ids or params.ignore_eos:
            return params
        extra = [t for t in self._extra_eos_ids if t not in params.stop_token_ids]
        if not extra:
            return params
        return dataclasses.replace(params, stop_token_ids=params.stop_token_ids + extra)

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        """Abort and return the final (aborted) outputs of those that were still unfinished."""
        self.scheduler.abort_requests(request_ids, now=time.time())
        outputs = []
        for rid in request_ids:
            state = self.states.pop(rid, None)
            if state is not None:
                outputs.append(self.output_processor.make_output(state))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------ the step

    def step(self) -> list[RequestOutput]:
        scheduler_output = self.scheduler.schedule(now=time.time())
        if self.on_scheduled is not None:
            self.on_scheduled(scheduler_output)
        try:
            runner_output = self.runner.execute_model(scheduler_output)
            now = time.time()
            updates = self.scheduler.update_from_output(scheduler_output, runner_output.sampled_token_ids, now)
        except BaseException:
            self.scheduler.fail_step(scheduler_output, time.time())
            raise
        stopped = []
        for update in updates:
            rid = update.request.request_id
            try:
                if self.output_processor.process_tokens(self.states[rid], len(update.new_token_ids),
                                                        runner_output.logprobs.get(rid)):
                    stopped.append(rid)
            except Exception as e:  # one request's output failing must not fail the others
                self._failed[rid] = e
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED, now)
            for rid in stopped:
                request = self.states[rid].request
                if request.status == RequestStatus.FINISHED_LENGTH:
                    # The token that completed the stop string also hit max_tokens: the stop
                    # string is why the text ends where it does (vLLM reports "stop" too).
                    request.status = RequestStatus.FINISHED_STOPPED
        if self._failed:
            self.scheduler.abort_requests(list(self._failed), now)
        outputs = []
        for update in updates:
            rid = update.request.request_id
            if rid in self._failed:
                self.states.pop(rid, None)
                continue
            outputs.append(self.output_processor.make_output(self.states[rid]))
            if update.request.is_finished:
                del self.states[rid]
        self.last_scheduler_output = scheduler_output
        return outputs

    def take_failed_requests(self) -> dict[str, Exception]:
        """Requests whose output processing raised since the last call: already aborted (blocks
        freed) and left out of step()'s outputs; the caller reports the errors."""
        failed, self._failed = self._failed, {}
        return failed

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    def reset_prefix_cache(self) -> None:
        self.scheduler.reset_prefix_cache()

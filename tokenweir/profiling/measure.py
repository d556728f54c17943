"""Timing real engine steps over a grid of step shapes, for fitting the step cost model.

The engine runs as it serves: the real scheduler picks each step and every step is timed whole
(schedule, forward, sampling, output processing), because that is what a simulated step stands
for. The grid only shapes the workload so the steps cover the space the simulator will ask
about: decode batches of many sizes at short and long contexts, prefill chunks of many sizes at
several offsets, and decodes mixed with a prefill chunk. Every step taken, warm-up excepted, is
a sample, with its composition read from the scheduler's output.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from tokenweir.core.batch_control import StaticBatchController, StepLimits
from tokenweir.core.cost_model import StepComposition, step_composition
from tokenweir.engine import serving_threads
from tokenweir.engine.core import EngineCore
from tokenweir.request import SamplingParams


@dataclass(frozen=True, slots=True)
class StepSample:
    composition: StepComposition
    seconds: float
    region: str  # the grid region that produced it ("decode", "prefill", "mixed")


@dataclass(frozen=True, slots=True)
class ProfileGrid:
    decode_batches: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
    decode_contexts: tuple[int, ...] = (32, 384, 1024)
    prefill_chunks: tuple[int, ...] = (16, 64, 256, 1024)
    prefill_length: int = 2048  # each chunk size prefills one prompt this long
    mixed_batches: tuple[int, ...] = (4, 24)
    mixed_chunks: tuple[int, ...] = (32, 256)
    mixed_length: int = 512  # the prompt prefilled in chunks next to the decodes
    decode_steps: int = 4  # timed steps per decode point

    @classmethod
    def quick(cls) -> ProfileGrid:
        """A small grid for tests and a first look."""
        return cls(decode_batches=(1, 4, 16), decode_contexts=(16, 64), prefill_chunks=(8, 32),
                   prefill_length=64, mixed_batches=(2,), mixed_chunks=(16,), mixed_length=32,
                   decode_steps=2)

    def max_tokens(self) -> int:
        return max(max(self.prefill_chunks), max(self.mixed_chunks) + max(self.mixed_batches),
                   max(self.decode_batches))

    def max_len(self) -> int:
        """The longest request: a decode point's prompt, the tokens it decodes while the rest
        of its batch prefills (a step each), and its timed steps."""
        decode = max(self.decode_context_need(b, c) for b in self.decode_batches for c in self.decode_contexts)
        return max(self.prefill_length + 1, self.mixed_length + 1, decode)

    def decode_context_need(self, batch: int, context: int) -> int:
        prefill_steps = -(-batch * context // self.max_tokens()) + batch
        return context + prefill_steps + self.decode_steps * len(self.decode_batches) + 2

    def max_seqs(self) -> int:
        return max(self.decode_batches + self.mixed_batches)


class StepTimer:
    """Runs an engine step by step and records each step's composition and time."""

    def __init__(self, engine: EngineCore, kv_bytes_per_block: int,
                 before_step: Callable[[int], None] = serving_threads.before_step) -> None:
        self.engine = engine
        self.kv_bytes_per_block = kv_bytes_per_block
        self.before_step = before_step
        self.samples: list[StepSample] = []
        self._ids = itertools.count()
        self._rng = np.random.default_rng(0)

    def add(self, num_prompt_tokens: int, max_tokens: Optional[int] = None) -> str:
        """Queue a request of random ids; without `max_tokens` it decodes until aborted (or
        until max_model_len), so that none finishes while the others of its batch prefill."""
        rid = f"profile-{next(self._ids)}"
        if max_tokens is None:
            max_tokens = self.engine.max_model_len - num_prompt_tokens
        vocab = self.engine.loaded.arch.vocab_size
        # Random ids: no two prompts share a prefix, so nothing is a prefix-cache hit by accident.
        prompt = self._rng.integers(0, vocab, size=num_prompt_tokens).tolist()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(rid, prompt, params)
        return rid

    def step(self, region: str, record: bool = True) -> None:
        start = time.perf_counter()
        scheduled = self.engine.schedule()
        comp = step_composition(scheduled, self.engine.scheduler.requests, self.kv_bytes_per_block)
        self.before_step(scheduled.total_num_scheduled_tokens)
        result = self.engine.execute(scheduled)
        seconds = time.perf_counter() - start
        if result.failed:
            raise RuntimeError(f"profile step failed: {next(iter(result.failed.values()))!r}")
        if record and comp.num_tokens:
            self.samples.append(StepSample(comp, seconds, region))

    def drain(self, region: str) -> None:
        """Step until every request has finished."""
        while self.engine.has_unfinished_requests():
            self.step(region)


def _set_budget(engine: EngineCore, tokens: int) -> None:
    """Shape the next steps: the scheduler reads its token budget from its batch controller."""
    seqs = min(tokens, engine.scheduler_config.max_num_seqs)
    engine.scheduler.batch_controller = StaticBatchController(StepLimits(tokens, seqs))


def _prefill_all(timer: StepTimer) -> None:
    """Step until every request has its prompt computed (those steps are samples too)."""
    scheduler = timer.engine.scheduler
    while scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running):
        timer.step("prefill")


def run_grid(timer: StepTimer, grid: ProfileGrid,
             progress: Callable[[str], None] = lambda s: None) -> Iterator[None]:
    """Run every grid point; yields after each so a caller can show progress."""
    engine = timer.engine
    # Warm-up: the first steps pay for lazy kernel builds and allocator growth.
    _set_budget(engine, grid.max_tokens())
    timer.add(64, 4)
    timer.add(8, 4)
    while engine.has_unfinished_requests():
        timer.step("warmup", record=False)

    batches = sorted(grid.decode_batches, reverse=True)
    for context in grid.decode_contexts:
        # Prefill the largest batch once, then time its decode steps while aborting requests
        # down to each smaller batch: prompts are the expensive part of the profile, and
        # a few tokens more context per batch size change nothing that matters.
        progress(f"decode at context {context}: prefill {batches[0]} prompts")
        _set_budget(engine, max(grid.max_tokens(), batches[0]))
        ids = [timer.add(context) for _ in range(batches[0])]
        _prefill_all(timer)
        for batch in batches:
            engine.abort_requests(ids[batch:])
            del ids[batch:]
            for _ in range(grid.decode_steps):
                timer.step("decode")
        engine.abort_requests(ids)
        yield

    for chunk in grid.prefill_chunks:
        progress(f"prefill chunk {chunk}")
        _set_budget(engine, chunk)
        timer.add(grid.prefill_length, 1)
        timer.drain("prefill")
        yield

    for batch in grid.mixed_batches:
        for chunk in grid.mixed_chunks:
            progress(f"mixed: {batch} decodes + chunk {chunk}")
            _set_budget(engine, max(grid.max_tokens(), batch))
            ids = [timer.add(min(grid.decode_contexts)) for _ in range(batch)]
            _prefill_all(timer)
            _set_budget(engine, batch + chunk)
            prompt = timer.add(grid.mixed_length, 1)
            while prompt in engine.scheduler.requests:
                timer.step("mixed")
            engine.abort_requests(ids)
            yield


def measure_copy_bandwidth(kv_caches: list[torch.Tensor], num_blocks: int = 64, repeats: int = 5) -> float:
    """Bytes per second of copying whole KV blocks out of the cache tensors into a second pool
    and back, as swapping does: a gather by block index, then a scatter into the cache itself.
    Each layer's cache is [2 (K, V), num_blocks, ...]."""
    first = kv_caches[0]
    n = min(num_blocks, first.shape[1] // 2)
    if n < 1:
        raise ValueError("the KV cache is too small to time a block copy")
    pin = first.device.type == "cuda"
    host = [torch.empty((c.shape[0], n, *c.shape[2:]), dtype=c.dtype, pin_memory=pin) for c in kv_caches]
    index = torch.arange(n, device=first.device)
    nbytes = 2 * sum(h.numel() * h.element_size() for h in host)  # out and back in
    best = float("inf")
    for _ in range(repeats):
        if pin:
            torch.cuda.synchronize(first.device)
        start = time.perf_counter()
        for cache, h in zip(kv_caches, host):
            h.copy_(cache.index_select(1, index))
            cache.index_copy_(1, index, h.to(cache.device, non_blocking=pin))
        if pin:
            torch.cuda.synchronize(first.device)
        best = min(best, time.perf_counter() - start)
    return nbytes / best

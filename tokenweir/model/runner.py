"""SchedulerOutput -> flattened input tensors -> forward -> sample -> ModelRunnerOutput.

The runner keeps its own copy of every scheduled request's tokens and block table, updated only
from SchedulerOutput (new requests arrive whole, cached ones send new block ids), so it could
live in another process. Tokens are sampled only for requests whose prompt (or recomputation
after preemption) is complete after this step.

A step is a transaction: the scheduler's `num_computed_tokens` says where each request stands
(the runner keeps no count of its own that could drift), and the runner's state takes the
step's new requests, block ids and sampled tokens only once the forward pass and sampling have
succeeded. A step that raised leaves the runner as it was, so the same SchedulerOutput can be
run again, or its requests dropped (`drop_requests`), except for the seeded generators its
draws advanced (the engine fails a failed step's requests, so none is drawn from again).

Swap preemption: a swapped-out request is dropped like a preempted one (its generator kept) and
comes back as a new request whose computed tokens' K/V the step's swap-in copies restore. The
copies come first in a step: out before the forward pass writes into the freed device blocks,
in before attention reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch

from tokenweir.core.scheduler import NewRequestData, SchedulerOutput
from tokenweir.model.attention import AttentionMetadata, allocate_kv_caches
from tokenweir.model.loader import LoadedModel
from tokenweir.model.sampler import Sampler, SamplingMetadata, TokenHistory, advance_generator, bias_tensors
from tokenweir.model.swap import HostKVCache
from tokenweir.request import SamplingParams

Logprobs = tuple[float, list[tuple[int, float]]]  # sampled token's logprob, top (token, logprob)


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, Logprobs] = field(default_factory=dict)


@dataclass
class _RequestState:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    sampling_params: SamplingParams
    generator: Optional[torch.Generator]
    # Built once per admission, read every step: a penalised request's tokens as a tensor
    # (grown by each sampled token at commit), and its logit_bias as tensors.
    history: Optional[TokenHistory] = None
    bias: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    kv_int8: bool = False  # its blocks hold int8 K/V


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, seed: int = 0,
                 num_host_blocks: int = 0, *, int8_block_size: int = 0) -> None:
        self.model = loaded.model
        self.device = loaded.device
        self.block_size = block_size
        self.int8_block_size = int8_block_size  # tokens of an int8 request's block (0: none is)
        self.kv_caches = allocate_kv_caches(loaded.arch, num_blocks, block_size, loaded.dtype, loaded.device)
        self.host_kv_cache = HostKVCache(self.kv_caches, num_host_blocks) if num_host_blocks else None
        # The last step whose swap-out copies were made: a step run again after it raised must
        # not copy again, since its first attempt may have written into the freed blocks.
        self._swapped_out_step: Optional[int] = None
        self.sampler = Sampler()
        self.requests: dict[str, _RequestState] = {}
        # Seeded requests' generators, kept from first admission to finish: a preempted request
        # resumes its random stream where it stopped, so a seed gives the same text however
        # often the request is preempted.
        self.generators: dict[str, torch.Generator] = {}
        torch.manual_seed(seed)  # unseeded sampling draws from the global generator

    def drop_requests(self, request_ids: Iterable[str], *, keep_generators: bool = False) -> None:
        """Forget requests (finished, aborted, failed; preempted ones keep their generators).
        Unknown ids are ignored, so a drop may be repeated."""
        for rid in request_ids:
            self.requests.pop(rid, None)
            if not keep_generators:
                self.generators.pop(rid, None)

    def _new_state(self, new: NewRequestData) -> _RequestState:
        generator = None
        if new.sampling_params.seed is not None:
            # A private generator per request: the same seed gives the same text whatever else
            # shares the batch. Stored only when the step succeeds (see execute_model).
            generator = self.generators.get(new.request_id)
            if generator is None:
                generator = torch.Generator(device=self.device).manual_seed(new.sampling_params.seed)
                if not new.sampling_params.greedy:  # a greedy row draws nothing
                    # A request resumed with another engine's outputs (failover) goes on with
                    # its random stream after the draws its outputs took there.
                    advance_generator(generator, len(new.token_ids) - new.num_prompt_tokens)
        params = new.sampling_params
        return _RequestState(
            list(new.token_ids), new.num_prompt_tokens, list(new.block_ids), params, generator,
            TokenHistory(new.token_ids, new.num_prompt_tokens, self.device) if params.penalized else None,
            bias_tensors(params.logit_bias, self.device) if params.logit_bias else None, new.kv_int8)

    def _swap(self, out: SchedulerOutput) -> None:
        if not (out.blocks_to_swap_out or out.blocks_to_swap_in):
            return
        if self.host_kv_cache is None:
            raise RuntimeError(f"step {out.step_id} swaps blocks, but this runner has no swap space")
        if out.blocks_to_swap_out and self._swapped_out_step != out.step_id:
            self.host_kv_cache.swap_out(self.kv_caches, out.blocks_to_swap_out)
            self._swapped_out_step = out.step_id
        # Idempotent: no step swaps out between a swap-in's schedule and its run.
        self.host_kv_cache.swap_in(self.kv_caches, out.blocks_to_swap_in)

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        # Drops are idempotent, so they may happen before the step can still fail.
        self.drop_requests(out.finished_req_ids)
        self.drop_requests(out.preempted_req_ids, keep_generators=True)
        self._swap(out)  # even in a step that computes nothing: its victims' K/V must go out
        # The step's view of each request, committed to self.requests only after sampling.
        states = {new.request_id: self._new_state(new) for new in out.scheduled_new_reqs}
        block_tables = {rid: s.block_ids for rid, s in states.items()}
        computed = {new.request_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        for rid, new_block_ids, num_computed in out.scheduled_cached_reqs.rows():
            states[rid] = self.requests[rid]
            blocks = states[rid].block_ids
            block_tables[rid] = blocks + new_block_ids if new_block_ids else blocks
            computed[rid] = num_computed
        if not out.num_scheduled_tokens:
            return ModelRunnerOutput({})

        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        sample_ids: list[str] = []
        sample_rows: list[int] = []  # index of each sampling request's last token in the batch
        for rid, n in out.num_scheduled_tokens.items():
            state = states[rid]
            start, end = computed[rid], computed[rid] + n
            if end > len(state.token_ids):
                raise RuntimeError(f"request {rid!r}: scheduled up to token {end}, the runner holds "
                                   f"{len(state.token_ids)}")
            input_ids.extend(state.token_ids[start:end])
            positions.extend(range(start, end))
            query_lens.append(n)
            seq_lens.append(end)
            if end == len(state.token_ids):
                sample_ids.append(rid)
                sample_rows.append(len(input_ids) - 1)

        int8_rows = [states[rid].kv_int8 for rid in out.num_scheduled_tokens] if self.int8_block_size else None
        meta = AttentionMetadata.build(query_lens, seq_lens, [block_tables[rid] for rid in out.num_scheduled_tokens],
                                       self.block_size, self.device, int8_rows=int8_rows,
                                       int8_block_size=self.int8_block_size)
        hidden = self.model(torch.tensor(input_ids, device=self.device),
                            torch.tensor(positions, device=self.device), meta, self.kv_caches)
        result = ModelRunnerOutput({})
        if sample_ids:
            logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
            sampled = self.sampler(logits, self._sampling_metadata([states[rid] for rid in sample_ids]))
            for i, rid in enumerate(sample_ids):
                result.sampled_token_ids[rid] = [sampled.token_ids[i]]
                if sampled.logprobs[i] is not None:
                    result.logprobs[rid] = (sampled.logprobs[i], sampled.top_logprobs[i] or [])

        # Commit: nothing below can fail.
        for rid, state in states.items():
            state.block_ids = block_tables[rid]
            self.requests[rid] = state
            if state.generator is not None:
                self.generators[rid] = state.generator
        for rid, tokens in result.sampled_token_ids.items():
            states[rid].token_ids.extend(tokens)
            if states[rid].history is not None:
                states[rid].history.extend(tokens)
        return result

    def _sampling_metadata(self, states: list[_RequestState]) -> SamplingMetadata:
        params = [s.sampling_params for s in states]
        # Most steps have no penalised or biased row: their per-row lists are left out.
        penalised = any(s.history is not None for s in states)
        biased = any(s.bias is not None for s in states)
        return SamplingMetadata.build(
            [p.temperature for p in params],
            top_p=[p.top_p for p in params],
            top_k=[p.top_k for p in params],
            min_p=[p.min_p for p in params],
            generators=[s.generator for s in states],
            min_tokens=[p.min_tokens for p in params],
            output_lens=[len(s.token_ids) - s.num_prompt_tokens for s in states],
            # The ids that would end the request: EngineCore folds every EOS id of the model
            # into stop_token_ids (unless ignore_eos), so this is the scheduler's stop set.
            stop_token_ids=[p.stop_token_ids for p in params],
            num_logprobs=[p.logprobs for p in params],
            presence_penalty=[p.presence_penalty for p in params] if penalised else None,
            frequency_penalty=[p.frequency_penalty for p in params] if penalised else None,
            repetition_penalty=[p.repetition_penalty for p in params] if penalised else None,
            logit_bias=[s.bias for s in states] if biased else None,
            prompt_token_ids=[() if s.history is None else s.history.prompt for s in states] if penalised else None,
            output_token_ids=[() if s.history is None else s.history.output for s in states] if penalised else None,
            device=self.device,
        )

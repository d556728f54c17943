"""SchedulerOutput -> flattened input tensors -> forward -> sample -> ModelRunnerOutput.

The runner keeps its own copy of every scheduled request's tokens and block table, updated only
from SchedulerOutput (new requests arrive whole, cached ones send new block ids), so it could
live in another process. Tokens are sampled only for requests whose prompt (or recomputation
after preemption) is complete after this step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from tokenweir.core.scheduler import NewRequestData, SchedulerOutput
from tokenweir.model.attention import AttentionMetadata, allocate_kv_caches
from tokenweir.model.loader import LoadedModel
from tokenweir.model.sampler import Sampler, SamplingMetadata
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
    num_computed_tokens: int
    sampling_params: SamplingParams
    generator: Optional[torch.Generator]
    banned_until_min_tokens: list[int]  # EOS and stop ids, masked while output < min_tokens


class ModelRunner:
    def __init__(self, loaded: LoadedModel, num_blocks: int, block_size: int, seed: int = 0) -> None:
        self.model = loaded.model
        self.arch = loaded.arch
        self.device = loaded.device
        self.block_size = block_size
        self.kv_caches = allocate_kv_caches(loaded.arch, num_blocks, block_size, loaded.dtype, loaded.device)
        self.sampler = Sampler()
        self.requests: dict[str, _RequestState] = {}
        # Seeded requests' generators, kept from first admission to finish: a preempted request
        # resumes its random stream where it stopped, so a seed gives the same text however
        # often the request is preempted.
        self.generators: dict[str, torch.Generator] = {}
        torch.manual_seed(seed)  # unseeded sampling draws from the global generator

    def _add_request(self, new: NewRequestData) -> None:
        params = new.sampling_params
        generator = None
        if params.seed is not None:
            # A private generator per request: the same seed gives the same text whatever else
            # shares the batch.
            generator = self.generators.get(new.request_id)
            if generator is None:
                generator = torch.Generator(device=self.device).manual_seed(params.seed)
                self.generators[new.request_id] = generator
        banned = list(params.stop_token_ids)
        if not params.ignore_eos:
            banned += [t for t in self.arch.eos_token_ids if t not in banned]
        self.requests[new.request_id] = _RequestState(
            list(new.token_ids), new.num_prompt_tokens, list(new.block_ids), new.num_computed_tokens,
            params, generator, banned)

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for rid in out.finished_req_ids:
            self.generators.pop(rid, None)
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.requests.pop(rid, None)
        for new in out.scheduled_new_reqs:
            self._add_request(new)
        for cached in out.scheduled_cached_reqs:
            state = self.requests[cached.request_id]
            state.block_ids.extend(cached.new_block_ids)
        if not out.num_scheduled_tokens:
            return ModelRunnerOutput({})

        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        block_tables: list[list[int]] = []
        sample_ids: list[str] = []
        sample_rows: list[int] = []  # index of each sampling request's last token in the batch
        for rid, n in out.num_scheduled_tokens.items():
            state = self.requests[rid]
            start, end = state.num_computed_tokens, state.num_computed_tokens + n
            input_ids.extend(state.token_ids[start:end])
            positions.extend(range(start, end))
            query_lens.append(n)
            seq_lens.append(end)
            block_tables.append(state.block_ids)
            state.num_computed_tokens = end
            if end == len(state.token_ids):
                sample_ids.append(rid)
                sample_rows.append(len(input_ids) - 1)

        meta = AttentionMetadata.build(query_lens, seq_lens, block_tables, self.block_size, self.device)
        hidden = self.model(torch.tensor(input_ids, device=self.device),
                            torch.tensor(positions, device=self.device), meta, self.kv_caches)
        if not sample_ids:
            return ModelRunnerOutput({})
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        states = [self.requests[rid] for rid in sample_ids]
        sampled = self.sampler(logits, self._sampling_metadata(states))

        result = ModelRunnerOutput({})
        for i, (rid, state) in enumerate(zip(sample_ids, states)):
            token = sampled.token_ids[i]
            state.token_ids.append(token)
            result.sampled_token_ids[rid] = [token]
            if sampled.logprobs[i] is not None:
                result.logprobs[rid] = (sampled.logprobs[i], sampled.top_logprobs[i] or [])
        return result

    def _sampling_metadata(self, states: list[_RequestState]) -> SamplingMetadata:
        params = [s.sampling_params for s in states]
        return SamplingMetadata.build(
            [p.temperature for p in params],
            top_p=[p.top_p for p in params],
            top_k=[p.top_k for p in params],
            min_p=[p.min_p for p in params],
            generators=[s.generator for s in states],
            min_tokens=[p.min_tokens for p in params],
            output_lens=[len(s.token_ids) - s.num_prompt_tokens for s in states],
            stop_token_ids=[s.banned_until_min_tokens for s in states],
            num_logprobs=[p.logprobs for p in params],
            device=self.device,
        )

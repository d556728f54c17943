"""`--batch-controller slo` changes only how much of a prompt each step computes and how many
requests run: greedy outputs still equal transformers' greedy generate token for token, holding
ITL or TPOT, with every prompt chunk cut by the controller and recompute preemptions on a small
pool."""

from __future__ import annotations

import random

import pytest

from tests.engine.helpers import record_schedules
from tests.hf_reference import hf_greedy
from tokenweir import SamplingParams

NUM_NEW = 24


@pytest.mark.parametrize("hold", ["itl", "tpot"])
def test_slo_batch_control_keeps_greedy_outputs_equal_to_transformers(make_llm, tiny_model_dir, hold):
    from tests.model.tiny_models import VOCAB_SIZE

    folder = tiny_model_dir("llama")
    rng = random.Random(5)
    prompts = [[rng.randrange(3, VOCAB_SIZE) for _ in range(8 + 11 * i)] for i in range(8)]
    expected = hf_greedy(folder, prompts, NUM_NEW, pad_token_id=0)
    # A target of 1 ms, which no step of this machine meets: the aim shrinks to its floor, and
    # prompts go through in chunks cut to what it leaves beside the decode rows (16 tokens at
    # most), though the budget would take any prompt whole. The cap cannot shrink under 3 (the
    # model fits no decode row in 1 ms), so rows decode beside the prompts. 32 blocks of 4: a
    # few prompts and their outputs, so running requests are preempted (recompute).
    llm = make_llm(folder, batch_controller="slo", target_tpot_ms=1.0, batch_control_hold=hold, min_num_seqs=3,
                   enable_chunked_prefill=True, num_gpu_blocks_override=32, block_size=4, max_num_seqs=4,
                   max_num_batched_tokens=256)
    schedules = record_schedules(llm.engine)
    params = SamplingParams(max_tokens=NUM_NEW, min_tokens=NUM_NEW, temperature=0.0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    # The controller did cut: chunks that end inside their prompt in steps that left budget over
    # (nothing else here cuts a chunk: no long-prefill threshold, no partial-prefill limits).
    lengths = {str(i): len(p) for i, p in enumerate(prompts)}
    cut = [(rid, n) for out in schedules if out.total_num_scheduled_tokens < 256
           for rid, computed in out.prefill_num_computed_tokens.items()
           if computed + (n := out.num_scheduled_tokens[rid]) < lengths[rid]]
    # How many depends on the machine's step times: under tpot a step takes prompts whole while
    # no row has a token due (the run's start), so count prompts cut, not chunks (tpot cut 2
    # prompts into 4 chunks on a machine where it had cut more than 5 chunks on others).
    assert len({rid for rid, _ in cut}) >= 2, cut
    assert llm.engine.scheduler.num_preemptions > 0  # and the pool preempted

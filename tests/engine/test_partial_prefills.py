"""With concurrent partial-prefill limits on, greedy streams equal transformers' (fp32) and the
default scheduler's, token for token: only the order of admission changes."""

from __future__ import annotations

import random

from tests.engine.helpers import record_schedules
from tests.hf_reference import hf_greedy
from tokenweir import SamplingParams

NUM_NEW = 8
LIMITS = dict(max_num_batched_tokens=32, long_prefill_token_threshold=8, max_num_partial_prefills=3,
              max_long_partial_prefills=1, num_gpu_blocks_override=256)


def test_greedy_streams_are_unchanged_and_short_prompts_pass_long_ones(make_llm, tiny_model_dir):
    from tests.model.tiny_models import VOCAB_SIZE

    folder = tiny_model_dir("llama")
    rng = random.Random(3)
    # Long and short prompts interleaved, long ones first: short ones must pass them.
    lengths = [70, 90, 3, 5, 60, 2, 7, 80, 4]
    prompts = [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in lengths]
    expected = hf_greedy(folder, prompts, NUM_NEW, pad_token_id=0)
    params = SamplingParams(max_tokens=NUM_NEW, min_tokens=NUM_NEW, temperature=0.0)

    def generate(**engine_args) -> tuple[list[list[int]], list]:
        llm = make_llm(folder, **engine_args)
        schedules = record_schedules(llm.engine)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], schedules

    limited, schedules = generate(**LIMITS)
    default, _ = generate(max_num_batched_tokens=32, num_gpu_blocks_override=256)
    assert limited == expected
    assert default == expected
    # The scenario happened: a short prompt started while a long one that came before it waited.
    first_step = {}
    for n, out in enumerate(schedules):
        for new in out.scheduled_new_reqs:
            first_step.setdefault(len(new.token_ids), n)
    assert first_step[3] < first_step[90] and first_step[5] < first_step[90]


def test_engine_args_flags_exist():
    # Here, not in tests/core: the CLI parser builds the server's flags too (not torch-free).
    from tokenweir.cli import build_parser

    args = build_parser().parse_args(["serve", "--max-num-partial-prefills", "4", "--max-long-partial-prefills", "2"])
    assert (args.max_num_partial_prefills, args.max_long_partial_prefills) == (4, 2)

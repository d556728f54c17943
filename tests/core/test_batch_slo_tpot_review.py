"""Review of `slo` holding TPOT (`hold="tpot"`): defects found, each pinned (no torch)."""

from __future__ import annotations

from tests.core.helpers import assert_no_leaks, make_request, reference_stream, virtual_steps
from tests.core.test_batch_slo import DEEP_MODEL
from tokenweir.config import CacheConfig, SchedulerConfig
from tokenweir.core.batch_slo import SLOBatchConfig
from tokenweir.core.cost_model import step_composition
from tokenweir.core.scheduler import Scheduler


def _preempted_run(hold: str):
    """`b` decodes throughout; `a` (a long prompt, the least important) is displaced by `h`
    (recompute, no prefix caching: its whole context is computed again) and waits long enough
    for its due times to fall behind. Per prefill of `a`, the steps its chunks took."""
    config = SLOBatchConfig(target_tpot_ms=150.0, interval=0.3, window=2.0, hold=hold)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=2, batch_controller="slo",
                                  policy="priority", batch_control_config=config),
                  CacheConfig(block_size=4, num_blocks=2000, enable_prefix_caching=False), cost_model=DEEP_MODEL)
    a = make_request("a", 600, max_tokens=40, priority=2)
    b = make_request("b", 8, max_tokens=500, priority=1)
    h = make_request("h", 8, max_tokens=200, priority=0)
    arrivals = [(0.0, b), (0.5, a), (3.0, h)]
    prefills = [[]]  # a's chunks (more than one token: a prefill's), per admission
    for out, _, _ in virtual_steps(s, arrivals, lambda out: DEEP_MODEL.predict(step_composition(out, s.requests))):
        if "a" in out.preempted_req_ids:
            prefills.append([])
        if out.num_scheduled_tokens.get("a", 0) > 1:
            prefills[-1].append(out.num_scheduled_tokens["a"])
    for _, r in arrivals:
        assert r.output_token_ids == reference_stream(r.prompt_token_ids, r.num_output_tokens)
    assert_no_leaks(s)
    assert a.num_preemptions == 1
    return prefills


def test_a_request_recomputing_after_preemption_does_not_hold_the_step_to_its_past_due_time():
    # Back from a recompute preemption, `a` runs while it computes its context again: it has a
    # first token, its due time long past and its last token from before it was displaced, so
    # the step's room was negative and every chunk of that prefill (its own) was cut to
    # MIN_CHUNK_TOKENS (any other prompt's to nothing) while `b` had ample slack. It decodes
    # no token until that prefill is done: only decoding requests' due times hold the step.
    first, again = _preempted_run("tpot")
    assert len(first) == 3  # 600 tokens, 256 a step beside b's row (b has the slack)
    assert len(again) <= len(first) + 1, again  # its context (and outputs) again, as fast

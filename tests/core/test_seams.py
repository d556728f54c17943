"""The scheduler's injectable parts: a policy with lookahead and feedback, a batch controller
varying the step limits, a KV cache manager given from outside."""

from collections.abc import Sequence
from dataclasses import dataclass

import pytest

from tests.core.helpers import PagedFakeRunner, make_request, reference_stream, run_until_done, step
from tokenweir.config import CacheConfig, SchedulerConfig
from tokenweir.core.batch_control import BatchController, StepLimits
from tokenweir.core.kv_cache_manager import KVCacheManager
from tokenweir.core.policies import POLICIES, FCFSPolicy, PolicyConfig, ServedRequest
from tokenweir.core.scheduler import Scheduler
from tokenweir.request import Request


@dataclass(frozen=True)
class _LookaheadConfig(PolicyConfig):
    lookahead: int = 0


class _LookaheadFCFS(FCFSPolicy):
    """FCFS that lets admission pass over requests that cannot run now, and records feedback."""

    name = "test-lookahead"
    config_class = _LookaheadConfig

    def __init__(self, config=None) -> None:
        super().__init__(config)
        self.served: list[tuple[float, list[tuple[str, int, int, int]]]] = []
        self.begun: list[float] = []

    def admission_lookahead(self) -> int:
        return self.config.lookahead

    def begin_step(self, now, waiting, running) -> None:
        self.begun.append(now)

    def on_step_served(self, served: Sequence[ServedRequest], now: float) -> None:
        self.served.append((now, [(s.request.request_id, s.num_computed_tokens, s.num_recomputed_tokens,
                                   s.num_output_tokens) for s in served]))


def test_a_policy_config_of_the_wrong_type_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="policy 'test-lookahead' takes a _LookaheadConfig, got PolicyConfig"):
        _LookaheadFCFS(PolicyConfig())
    with pytest.raises(ValueError, match="scheduling policy 'priority' takes a PolicyConfig, got _LookaheadConfig"):
        SchedulerConfig(policy="priority", policy_config=_LookaheadConfig())


def test_a_registered_policy_is_built_from_the_config_it_is_given(monkeypatch):
    monkeypatch.setitem(POLICIES, _LookaheadFCFS.name, _LookaheadFCFS)
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, policy=_LookaheadFCFS.name,
                             policy_config=_LookaheadConfig(lookahead=3))
    s = Scheduler(config, CacheConfig(block_size=4, num_blocks=8))
    assert isinstance(s.policy, _LookaheadFCFS) and s.policy.admission_lookahead() == 3


@pytest.mark.parametrize("lookahead, admitted_second", [(0, ["big"]), (1, ["small"])])
def test_lookahead_lets_a_small_request_pass_one_that_cannot_fit_now(make_scheduler, lookahead, admitted_second):
    policy = _LookaheadFCFS(_LookaheadConfig(lookahead=lookahead))
    s = make_scheduler(policy=policy, num_blocks=8, max_num_batched_tokens=64)
    runner = PagedFakeRunner(s.block_size)
    first = make_request("first", 20, max_tokens=3)  # 5 blocks (6 with its outputs)
    s.add_request(first)
    step(s, runner, now=1.0)
    big, small = make_request("big", 16, max_tokens=1), make_request("small", 3, max_tokens=1)
    s.add_request(big)  # 4 blocks: must wait for "first"
    s.add_request(small)  # 1 block: fits now
    out = step(s, runner, now=2.0)
    assert [rid for rid in out.num_scheduled_tokens if rid != "first"] == ([] if lookahead == 0 else ["small"])
    # Passed over, "big" keeps its turn: it is still first in line.
    assert [r.request_id for r in s.waiting][0] == "big"
    run_until_done(s, runner)
    order = [rid for _, served in policy.served for rid, *_ in served if rid != "first"]
    assert order[0] == admitted_second[0]
    for r in (first, big, small):
        assert r.output_token_ids == reference_stream(r.prompt_token_ids, r.num_output_tokens)


def test_the_policy_sees_time_and_what_each_step_served_without_charging_recomputation(make_scheduler):
    policy = _LookaheadFCFS()
    s = make_scheduler(policy=policy, num_blocks=5, max_num_batched_tokens=64, enable_prefix_caching=False)
    runner = PagedFakeRunner(s.block_size)
    a, b = make_request("a", 7, max_tokens=6), make_request("b", 7, max_tokens=6)
    s.add_request(a)
    s.add_request(b)
    t = 0.0
    while s.has_unfinished_requests():
        step(s, runner, now=t)
        t += 1.0
    assert policy.begun == [float(i) for i in range(int(t))]
    assert [now for now, _ in policy.served] == policy.begun
    assert b.num_preemptions >= 1  # 5 blocks cannot hold both to the end
    for r in (a, b):
        served = [(c, rc, o) for _, step_served in policy.served for rid, c, rc, o in step_served if rid == r.request_id]
        computed = sum(c for c, _, _ in served)
        recomputed = sum(rc for _, rc, _ in served)
        assert sum(o for _, _, o in served) == r.num_output_tokens == 6
        # Every token's K/V computed once, plus exactly what preemption threw away.
        assert computed - recomputed == r.num_prompt_tokens + r.num_output_tokens - 1
        assert (recomputed > 0) == (r.num_preemptions > 0)


class _Shrinking(BatchController):
    """Budget 64 for two steps, then 3 tokens and 1 new sequence."""

    def __init__(self) -> None:
        self.calls: list[float] = []

    def get_limits(self, now: float) -> StepLimits:
        self.calls.append(now)
        return StepLimits(64, 4) if len(self.calls) <= 2 else StepLimits(3, 1)


def _scheduler(**parts) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4),
                     CacheConfig(block_size=4, num_blocks=64), **parts)


def test_the_step_limits_come_from_the_controller_and_shrinking_preempts_nobody():
    controller = _Shrinking()
    s = _scheduler(batch_controller=controller)
    runner = PagedFakeRunner(s.block_size)
    reqs = [make_request(f"r{i}", 5, max_tokens=6) for i in range(3)]
    for r in reqs[:2]:
        s.add_request(r)
    step(s, runner, now=0.0)
    step(s, runner, now=1.0)
    s.add_request(reqs[2])
    out = step(s, runner, now=2.0)  # limits (3 tokens, 1 sequence): two running decodes, no admission
    assert out.num_scheduled_tokens == {"r0": 1, "r1": 1} and out.preempted_req_ids == set()
    assert out.total_num_scheduled_tokens == 2
    while s.has_unfinished_requests():
        out = step(s, runner)
        assert out.total_num_scheduled_tokens <= 3
    assert controller.calls[:3] == [0.0, 1.0, 2.0]
    for r in reqs:
        assert r.output_token_ids == reference_stream(r.prompt_token_ids, 6)


def test_a_controller_may_not_exceed_the_configured_maxima():
    class _Greedy(BatchController):
        def get_limits(self, now: float) -> StepLimits:
            return StepLimits(128, 4)

    s = _scheduler(batch_controller=_Greedy())
    with pytest.raises(ValueError, match="exceed the configured maxima"):
        s.schedule()


def test_step_limits_are_validated():
    with pytest.raises(ValueError, match="step limit max_num_seqs must be an integer >= 1, got 0"):
        StepLimits(8, 0)
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(2\) must be >= max_num_seqs \(4\)"):
        StepLimits(2, 4)


def test_an_injected_kv_cache_manager_is_the_one_used():
    kv = KVCacheManager(num_blocks=3, block_size=4)  # smaller than the config's 64 blocks
    s = _scheduler(kv_cache_manager=kv)
    runner = PagedFakeRunner(s.block_size)
    a, b = make_request("a", 7, max_tokens=4), make_request("b", 7, max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    out = step(s, runner)
    assert list(out.num_scheduled_tokens) == ["a"]  # 2 of the 3 blocks; "b" needs 2 more
    assert s.kv_cache_manager is kv and kv.get_block_ids("a") != []
    run_until_done(s, runner)
    for r in (a, b):
        assert r.output_token_ids == reference_stream(r.prompt_token_ids, 4)
    assert kv.get_num_free_blocks() == 3

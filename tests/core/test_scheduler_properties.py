"""Property test: random workloads on tiny pools, both policies, chunking on and off, every
preemption mode (swap and auto on host tiers from one block up), with EOS, stop ids, stop-string
finishes, aborts, prefix-cache resets, cache salts and reused ids."""

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tokenweir.core.cost_model import FEATURES, StepCostModel
from tokenweir.request import RequestStatus
from tests.core.helpers import (EOS, PagedFakeRunner, assert_no_leaks, create_scheduler, make_request,
                                next_token, step)

PREFIXES = [list(range(10, 30)), list(range(40, 52)), []]
# For `auto`: a block out and back in costs as much as ~5 tokens' prefill, and attention makes
# long prefills dearer per token, so victims of either kind occur.
_COEFFICIENTS = {**dict.fromkeys(FEATURES, 0.0), "tokens": 1e-3, "prefill_attention": 1e-4}
AUTO_COSTS = StepCostModel(_COEFFICIENTS, swap_bytes_per_second=2 * 1000 / 5e-3)


def model(context: list[int]) -> int:
    """The fake model, emitting EOS now and then."""
    token = next_token(context)
    return EOS if token % 11 == 0 else token


def expected_stream(prompt: list[int], max_tokens: int, ignore_eos: bool, stop_ids: list[int]) -> list[int]:
    """What the request generates alone, stop conditions included."""
    context, out = list(prompt), []
    while len(out) < max_tokens:
        token = model(context)
        out.append(token)
        context.append(token)
        if (token == EOS and not ignore_eos) or token in stop_ids:
            break
    return out


@st.composite
def workloads(draw, modes=("recompute", "swap", "auto"), tight=False):
    """`tight`: a small pool, several sequences, longer outputs arriving together and fewer
    aborts, so that most workloads preempt."""
    chunked = draw(st.booleans())
    budget = draw(st.integers(4, 48))
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    min_blocks = max(2, -(-8 // block_size))
    # Small pools half of the time, so that preemption is common.
    small = st.integers(min_blocks, min_blocks + 4)
    if tight:  # room for a long prompt or two, not for all of them
        num_blocks = -(-draw(st.integers(24, 64)) // block_size)
    else:
        num_blocks = draw(st.one_of(small, st.integers(min_blocks, 40)))
    config = dict(
        max_num_batched_tokens=budget,
        max_num_seqs=draw(st.integers(min(2 if tight else 1, budget), min(6, budget))),
        block_size=block_size,
        num_blocks=num_blocks,
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3, 7])) if chunked else 0,
        enable_prefix_caching=draw(st.booleans()),
        watermark=draw(st.sampled_from([0.0, 0.0, 0.1, 0.3])),
        max_model_len=None if chunked else budget,
        preemption_mode=draw(st.sampled_from(modes)),
    )
    if config["preemption_mode"] != "recompute":
        config.update(num_host_blocks=draw(st.integers(1, 24)), kv_block_bytes=1000, cost_model=AUTO_COSTS)
    requests = []
    for i in range(draw(st.integers(3 if tight else 1, 10))):
        prefix = draw(st.sampled_from(PREFIXES))
        suffix = draw(st.lists(st.integers(100, 120), min_size=1, max_size=20))
        requests.append(dict(
            # A few ids are shared: the later request reuses the id once the earlier one is gone.
            rid=f"r{draw(st.integers(0, 7))}", prompt=prefix + suffix,
            max_tokens=draw(st.integers(1, 24 if tight else 10)),
            arrival_step=draw(st.integers(0, 3 if tight else 12)), priority=draw(st.integers(0, 3)),
            ignore_eos=draw(st.booleans()), salt=draw(st.sampled_from([None, None, "x", "y"])),
            stop_ids=draw(st.lists(st.integers(3, 1000), max_size=3)),
            abort_step=draw(st.one_of(*[st.none()] * (3 if tight else 1), st.integers(0, 30))),
            stop_string_step=draw(st.one_of(st.none(), st.integers(0, 30)))))
    resets = draw(st.lists(st.integers(0, 30), max_size=3))
    return config, requests, resets


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_every_invariant(workload):
    check_workload(*workload)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(modes=("swap", "auto"), tight=True))
def test_swapping_workloads_keep_every_invariant(workload):
    """The fake runner copies blocks between its device and host caches as told (and refuses a
    step that swaps both ways): streams stay exact however often requests are swapped."""
    check_workload(*workload)


def check_workload(config, specs, resets):
    s = create_scheduler(**config)
    runner = PagedFakeRunner(s.block_size, token_fn=model)
    added = []  # (spec, request), in the order they were added
    pending = list(specs)
    t = 0
    while t < 2000:
        for spec in list(pending):
            if spec["arrival_step"] <= t and spec["rid"] not in s.requests:
                r = make_request(spec["rid"], spec["prompt"], max_tokens=spec["max_tokens"],
                                 arrival_time=float(t), priority=spec["priority"], ignore_eos=spec["ignore_eos"],
                                 cache_salt=spec["salt"], stop_token_ids=spec["stop_ids"])
                s.add_request(r)
                added.append((spec, r))
                pending.remove(spec)
        for spec, r in added:
            if not r.is_finished and spec["abort_step"] == t:
                s.abort_requests([r.request_id], now=float(t))
            elif not r.is_finished and spec["stop_string_step"] == t and r.num_output_tokens:
                # What the output processor does when detokenized text matches a stop string.
                s.finish_requests([r.request_id], RequestStatus.FINISHED_STOPPED, now=float(t))
        if t in resets:
            s.reset_prefix_cache()
        if t > 12 and not pending and not s.has_unfinished_requests():
            break
        # `step` asserts the budget and max_num_seqs on every step.
        step(s, runner, now=float(t))
        t += 1
    assert not pending and not s.has_unfinished_requests(), "workload did not drain"
    assert_no_leaks(s)  # both tiers
    by_mode = s.get_stats().num_preemptions_by_mode
    event(f"{config['preemption_mode']}: swapped {by_mode['swap'] > 0}, recomputed {by_mode['recompute'] > 0}")
    for spec, r in added:
        assert r.is_finished
        full = expected_stream(r.prompt_token_ids, spec["max_tokens"], spec["ignore_eos"], spec["stop_ids"])
        # Whatever the batching, chunking, preemption, cache hits or salts, the stream is (a
        # prefix of, when cut short from outside) the one the request produces alone.
        assert r.output_token_ids == full[:r.num_output_tokens]
        if r.status == RequestStatus.FINISHED_LENGTH:
            assert r.num_tokens >= s.max_model_len or (
                r.output_token_ids == full and r.num_output_tokens == spec["max_tokens"])
        elif r.status == RequestStatus.FINISHED_STOPPED and r.output_token_ids == full and full[-1] in [EOS, *spec["stop_ids"]]:
            assert full[-1] in spec["stop_ids"] or not spec["ignore_eos"]
        elif r.status == RequestStatus.FINISHED_STOPPED:
            assert spec["stop_string_step"] is not None  # cut short by a "stop string"
        elif r.status == RequestStatus.FINISHED_IGNORED:
            assert r.num_prompt_tokens > s.max_model_len and r.num_output_tokens == 0
        else:
            assert r.status == RequestStatus.FINISHED_ABORTED and spec["abort_step"] is not None

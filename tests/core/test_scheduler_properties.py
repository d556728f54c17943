"""Property test: random workloads on tiny pools, both policies, chunking on and off."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenweir.request import RequestStatus
from tests.core.helpers import (PagedFakeRunner, assert_no_leaks, create_scheduler, make_request,
                                reference_stream, step)

PREFIXES = [list(range(10, 30)), list(range(40, 52)), []]


@st.composite
def workloads(draw):
    chunked = draw(st.booleans())
    budget = draw(st.integers(4, 48))
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    num_blocks = draw(st.integers(max(2, -(-8 // block_size)), 40))
    config = dict(
        max_num_batched_tokens=budget,
        max_num_seqs=draw(st.integers(1, min(6, budget))),
        block_size=block_size,
        num_blocks=num_blocks,
        policy=draw(st.sampled_from(["fcfs", "priority"])),
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, 3, 7])) if chunked else 0,
        enable_prefix_caching=draw(st.booleans()),
        watermark=draw(st.sampled_from([0.0, 0.0, 0.1, 0.3])),
        max_model_len=None if chunked else budget,
    )
    requests = []
    for i in range(draw(st.integers(1, 10))):
        prefix = draw(st.sampled_from(PREFIXES))
        suffix = draw(st.lists(st.integers(100, 120), min_size=1, max_size=20))
        requests.append(dict(
            rid=f"r{i}", prompt=prefix + suffix, max_tokens=draw(st.integers(1, 10)),
            arrival_step=draw(st.integers(0, 12)), priority=draw(st.integers(0, 3)),
            abort_step=draw(st.one_of(st.none(), st.integers(0, 30)))))
    return config, requests


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_every_invariant(workload):
    config, specs = workload
    s = create_scheduler(**config)
    runner = PagedFakeRunner(s.block_size)
    requests = {}
    t = 0
    while t < 2000:
        for spec in specs:
            if spec["arrival_step"] == t:
                r = make_request(spec["rid"], spec["prompt"], max_tokens=spec["max_tokens"],
                                 arrival_time=float(t), priority=spec["priority"], ignore_eos=True)
                requests[spec["rid"]] = r
                s.add_request(r)
            if spec["abort_step"] == t and spec["rid"] in requests:
                s.abort_requests([spec["rid"]], now=float(t))
        if t > 12 and not s.has_unfinished_requests():
            break
        # `step` asserts the budget and max_num_seqs on every step.
        step(s, runner, now=float(t))
        t += 1
    assert not s.has_unfinished_requests(), "workload did not drain"
    assert_no_leaks(s)
    for spec in specs:
        r = requests[spec["rid"]]
        assert r.is_finished
        # Whatever the batching, chunking, preemption or cache hits, the stream is the one the
        # request produces alone.
        assert r.output_token_ids == reference_stream(r.prompt_token_ids, r.num_output_tokens)
        if r.status == RequestStatus.FINISHED_LENGTH:
            assert (r.num_output_tokens == spec["max_tokens"]
                    or r.num_tokens >= s.max_model_len)
        elif r.status == RequestStatus.FINISHED_IGNORED:
            assert r.num_prompt_tokens > s.max_model_len and r.num_output_tokens == 0
        else:
            assert r.status == RequestStatus.FINISHED_ABORTED

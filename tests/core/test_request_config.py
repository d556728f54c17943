import pytest

from tokenweir.config import CacheConfig, EngineArgs, SchedulerConfig, parse_size
from tokenweir.core.policies.fair_share import VTCConfig
from tokenweir.request import ParameterError, Request, RequestStatus, SamplingParams, SchedulingHints


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(max_tokens=2.5), "max_tokens must be an integer >= 1"),
    (dict(min_tokens=-1), "min_tokens must be an integer >= 0"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens must be <= max_tokens"),
    (dict(temperature=-0.1), "temperature must be a number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a number >= 0"),
    (dict(temperature=float("inf")), "temperature must be a number >= 0"),
    (dict(temperature=10**400), "temperature must be a number >= 0"),  # no float holds it
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-2), "top_k must be -1 or 0"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
    (dict(stop=[""]), "stop must be a string or a list of strings, each of 1 to 1024 characters"),
    (dict(stop=["x" * 1025]), "each of 1 to 1024 characters"),
    (dict(stop=["s"] * 257), "stop may hold at most 256 strings, got 257"),
    (dict(stop_token_ids=[7] * 1025), "stop_token_ids must be a list of at most 1024 token ids"),
    (dict(stop=5), "stop must be a non-empty string or a list of them, got 5"),
    (dict(stop_token_ids=5), "stop_token_ids must be a list of at most 1024 token ids, got 5"),
    (dict(ignore_eos="yes"), "ignore_eos must be true or false, got 'yes'"),
    (dict(skip_special_tokens=1), "skip_special_tokens must be true or false"),
    (dict(stop_token_ids=[-1]), "stop_token_ids must be a list of non-negative integers"),
    (dict(seed="x"), "seed must be an integer"),
    (dict(seed=2**64), r"seed must be an integer in \[-2\*\*63, 2\*\*64\)"),
    (dict(top_k=2**70), "top_k must be -1 or 0 .* below 2\\*\\*63"),
    (dict(stop_token_ids=[2**63]), "stop_token_ids must be a list of non-negative integers"),
    (dict(logprobs=21), r"logprobs must be an integer in \[0, 20\]"),
    (dict(n=2), "n must be 1"),
])
def test_sampling_params_validation(kwargs, message):
    with pytest.raises(ParameterError, match=message) as info:
        SamplingParams(**kwargs)
    assert info.value.param == next(iter(kwargs))  # the field a client would fix


def test_sampling_params_limits_are_inclusive():
    SamplingParams(stop=["x" * 1024] * 256, stop_token_ids=[7] * 1024)


@pytest.mark.parametrize("kwargs, message", [
    (dict(priority=2**31), r"priority must be an integer in \[-2147483648, 2147483647\], got 2147483648"),
    (dict(priority=-(2**31) - 1), "priority must be an integer in"),
    (dict(priority=True), "priority must be an integer in"),
    (dict(deadline=float("inf")), "deadline must be a finite number of seconds > 0"),
    (dict(ttft_slo=0), "ttft_slo must be a finite number of seconds > 0"),
    (dict(tpot_slo=float("nan")), "tpot_slo must be a finite number of seconds > 0"),
    (dict(tenant=""), "tenant must be a non-empty string of at most 256 characters"),
    (dict(cache_salt="s" * 257), "cache_salt must be a non-empty string of at most 256"),
    (dict(arrival_time=float("inf")), "arrival_time must be a finite number"),
])
def test_scheduling_hints_validation(kwargs, message):
    with pytest.raises(ParameterError, match=message) as info:
        SchedulingHints(**kwargs)
    assert info.value.param == next(iter(kwargs))


def test_scheduling_hints_round_trip_through_a_dict():
    hints = SchedulingHints(priority=-3, tenant="acme", deadline=2.5, ttft_slo=0.2, tpot_slo=0.05,
                            cache_salt="salt", arrival_time=12.0)
    assert SchedulingHints.from_dict(hints.to_dict()) == hints
    with pytest.raises(ValueError, match=r"unknown scheduling hints \['colour'\]"):
        SchedulingHints.from_dict({"colour": "red"})


def test_request_reads_its_hints():
    r = Request("r", [1, 2], arrival_time=10.0,
                hints=SchedulingHints(priority=2, tenant="t", deadline=3.0, cache_salt="s"))
    assert (r.priority, r.tenant, r.deadline, r.cache_salt, r.ttft_slo) == (2, "t", 13.0, "s", None)


def test_sampling_params_normalises_stop():
    p = SamplingParams(stop="###", stop_token_ids=None, temperature=0)
    assert p.stop == ["###"] and p.stop_token_ids == [] and p.greedy


def test_request_needs_a_prompt_and_tracks_tokens():
    with pytest.raises(ValueError, match="at least one token"):
        Request("x", [])
    r = Request("x", [1, 2])
    r.append_output_token(3, now=1.5)
    assert (r.num_tokens, r.all_token_ids, r.first_token_time) == (3, [1, 2, 3], 1.5)
    assert r.status == RequestStatus.WAITING and r.finish_reason is None


@pytest.mark.parametrize("kwargs, message", [
    (dict(request_id=7), "request_id must be a non-empty string, got 7"),
    (dict(request_id=""), "request_id must be a non-empty string"),
    (dict(prompt_token_ids="abc"), "prompt_token_ids must be token ids, not text"),
    (dict(sampling_params=None), "sampling_params must be SamplingParams, got NoneType"),
    (dict(hints=None), "hints must be SchedulingHints, got NoneType"),
    (dict(arrival_time=float("nan")), "arrival_time must be a finite number, got nan"),
    (dict(arrival_time="0"), "arrival_time must be a finite number, got '0'"),
    (dict(eos_token_id="2"), "eos_token_id must be a token id or None, got '2'"),
    (dict(eos_token_id=-1), "eos_token_id must be a token id or None, got -1"),
])
def test_request_refuses_what_it_cannot_be_made_of(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Request(**{"request_id": "r", "prompt_token_ids": [1, 2], **kwargs})


def test_chunking_off_needs_a_budget_of_max_model_len():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(512\) is smaller than max_model_len "
                                         r"\(2048\) while enable_chunked_prefill is off"):
        SchedulerConfig(max_num_batched_tokens=512, max_model_len=2048, enable_chunked_prefill=False)
    SchedulerConfig(max_num_batched_tokens=512, max_model_len=2048, enable_chunked_prefill=True)


@pytest.mark.parametrize("make, message", [
    (lambda: SchedulerConfig(policy="lottery"), "scheduling_policy must be one of"),
    (lambda: SchedulerConfig(policy=["fcfs"]), r"scheduling_policy must be one of .*got \['fcfs'\]"),
    (lambda: SchedulerConfig(batch_controller=["slo"]), r"batch_controller must be one of .*got \['slo'\]"),
    (lambda: VTCConfig(tenant_weights={1: 2.0}), "vtc tenant weights are keyed by tenant name"),
    (lambda: SchedulerConfig(max_num_seqs=0), "max_num_seqs must be an integer >= 1, got 0"),
    (lambda: SchedulerConfig(max_num_seqs="8"), "max_num_seqs must be an integer >= 1, got '8'"),
    (lambda: SchedulerConfig(max_num_batched_tokens=True), "max_num_batched_tokens must be an integer"),
    (lambda: SchedulerConfig(enable_chunked_prefill=False, long_prefill_token_threshold=4),
     r"long_prefill_token_threshold \(4\) splits prompts into chunks, but enable_chunked_prefill is off"),
    (lambda: CacheConfig(swap_space=4), r"swap_space \(4 GiB\) would never be used"),
    (lambda: CacheConfig(num_host_blocks=8), r"num_host_blocks \(8\) would never be used"),
    (lambda: CacheConfig(preemption_mode="swap"),
     r"preemption_mode 'swap' swaps to host memory, but swap_space is 0"),
    (lambda: EngineArgs(preemption_mode="auto"),
     r"preemption_mode 'auto' swaps to host memory, but swap_space is 0"),
    (lambda: EngineArgs(preemption_mode="swap", swap_space=-1), r"swap_space must be a number >= 0"),
    (lambda: EngineArgs(preemption_mode="swap", swap_space=1e-9).num_host_blocks(4096),
     r"swap_space of 1e-09 GiB holds no KV block of 4096 bytes"),
    (lambda: CacheConfig(watermark="0.1"), r"watermark must be in \[0, 1\)"),
    (lambda: CacheConfig(watermark=1.0), r"watermark must be in \[0, 1\)"),
    (lambda: CacheConfig(preemption_mode="teleport"), "preemption_mode must be one of"),
    (lambda: CacheConfig(block_size=0), "block_size must be an integer >= 1, got 0"),
    (lambda: EngineArgs(num_gpu_blocks_override=64, kv_cache_memory="1GiB"),
     r"num_gpu_blocks_override \(64\) and kv_cache_memory \('1GiB'\) both size the KV pool"),
    (lambda: EngineArgs(num_gpu_blocks_override=0), "num_gpu_blocks_override must be an integer >= 1"),
    # Checked when the arguments are made, before any model is loaded.
    (lambda: EngineArgs(swap_space=4), r"swap_space \(4 GiB\) would never be used"),
    (lambda: EngineArgs(max_num_seqs=0), "max_num_seqs must be an integer >= 1, got 0"),
    (lambda: EngineArgs(enable_prefix_caching="no"), "enable_prefix_caching must be true or false, got 'no'"),
    (lambda: EngineArgs(gpu_memory_utilization=1.5), r"gpu_memory_utilization must be in \(0, 1\], got 1.5"),
    (lambda: EngineArgs(enable_chunked_prefill="false"), "enable_chunked_prefill must be true or false"),
    # Some running requests would get no token in a step (vLLM refuses this too).
    (lambda: SchedulerConfig(max_num_batched_tokens=8, max_num_seqs=16),
     r"max_num_batched_tokens \(8\) must be >= max_num_seqs \(16\)"),
    (lambda: EngineArgs(max_num_batched_tokens=8, max_num_seqs=16),
     r"max_num_batched_tokens \(8\) must be >= max_num_seqs \(16\)"),
])
def test_config_errors_name_the_setting(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_an_unset_sequence_cap_follows_a_small_budget():
    _, sched = EngineArgs(max_num_batched_tokens=24).create_engine_configs(model_max_len=8192, num_blocks=1024)
    assert (sched.max_num_batched_tokens, sched.max_num_seqs) == (24, 24)
    _, sched = EngineArgs().create_engine_configs(model_max_len=8192, num_blocks=1024)
    assert (sched.max_num_batched_tokens, sched.max_num_seqs) == (2048, 256)


def test_engine_args_resolve_against_model_and_pool():
    cache, sched = EngineArgs(max_num_seqs=8).create_engine_configs(model_max_len=8192, num_blocks=1024)
    assert sched.max_model_len == 8192 and sched.max_num_batched_tokens == 2048
    assert cache.num_blocks == 1024
    with pytest.raises(ValueError, match=r"max_model_len \(8192\) is larger than the KV cache can hold"):
        EngineArgs(max_model_len=8192).create_engine_configs(model_max_len=8192, num_blocks=100)
    _, sched = EngineArgs().create_engine_configs(model_max_len=8192, num_blocks=100)
    assert sched.max_model_len == 1600  # unset: shrunk to the pool
    with pytest.raises(ValueError, match=r"exceeds the model's context length \(2048\)"):
        EngineArgs(max_model_len=4096).create_engine_configs(model_max_len=2048, num_blocks=1000)
    _, sched = EngineArgs(enable_chunked_prefill=False, max_model_len=4096).create_engine_configs(
        model_max_len=8192, num_blocks=1000)
    assert sched.max_num_batched_tokens == 4096


@pytest.mark.parametrize("block_size", [0, 1, 15, -16])
def test_engine_block_size_must_be_positive_and_even(block_size):
    # The model's KV cache stores key and value pairs; the scheduler core alone takes any size.
    with pytest.raises(ValueError, match=f"block_size must be a positive even number of tokens, got {block_size}"):
        EngineArgs(block_size=block_size)


def test_parse_size():
    assert parse_size("2GiB") == 2 * 1024**3 and parse_size("512MiB") == 512 * 1024**2
    assert parse_size("1.5G") == 1_500_000_000 and parse_size(4096) == 4096
    with pytest.raises(ValueError, match="cannot parse memory size"):
        parse_size("lots")


@pytest.mark.parametrize("kwargs, param", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(presence_penalty=True), "presence_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=1e-30), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(logit_bias={1: 101.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"7": 1.0}), "logit_bias"),
    (dict(logit_bias={1: float("nan")}), "logit_bias"),
    (dict(logit_bias=[(1, 1.0)]), "logit_bias"),
    (dict(logit_bias={i: 1.0 for i in range(1025)}), "logit_bias"),
])
def test_bad_penalties_and_logit_bias_are_refused(kwargs, param):
    with pytest.raises(ParameterError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_penalties_default_to_off_and_logit_bias_is_copied():
    assert not SamplingParams().penalized
    assert SamplingParams(repetition_penalty=1.1).penalized and SamplingParams(presence_penalty=-0.1).penalized
    bias = {3: 1.0}
    params = SamplingParams(logit_bias=bias)
    bias[4] = 2.0
    assert not params.penalized and params.logit_bias == {3: 1.0}

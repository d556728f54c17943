"""Engine arguments (vLLM's names) and the two configs they resolve into.

`EngineArgs` is what users set; `create_engine_configs()` fills defaults that depend on the
model (max_model_len) and checks that the knobs agree with each other. No torch here.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field, fields, replace
from typing import Optional, Union

from tokenweir.checks import is_finite_number, is_integer
from tokenweir.core.composition import ADMISSION_ORDERS, CompositionConfig, check_admission_order
from tokenweir.core.batch_controllers import SLOBatchConfig, check_batch_control
from tokenweir.core.batch_slo import DEFAULT_MIN_NUM_BATCHED_TOKENS
from tokenweir.core.policies import POLICIES, PolicyConfig, SLAConfig, VTCConfig, parse_tenant_weights
from tokenweir.core.policies.sla_score import UNMEETABLE_MARGIN
from tokenweir.core.step_timing import LOW_RATIO_MIN_STEPS
from tokenweir.request import PRIORITY_MAX, PRIORITY_MIN

GENERATION_CONFIGS = ("auto", "vllm")  # vLLM's values (it also takes a folder)
PREEMPTION_MODES = ("recompute", "swap", "auto")  # auto: per victim, by cost (core/preemption.py)
LOW_PRIORITY_KV_CACHE_DTYPES = ("auto", "int8")  # auto: the model's dtype, as every other request
DEFAULT_LOW_PRIORITY_THRESHOLD = 1  # priority >= 1: less important than a request that sets none

_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
               "gb": 1000**3, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_size(value: Union[int, float, str]) -> int:
    """Bytes from 123, 1.5e9, "512MiB", "2GiB", "2G"."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"memory size must be positive, got {value!r}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"cannot parse memory size {value!r}; use bytes or e.g. '512MiB', '2GiB'")
    size = int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    if size <= 0:
        raise ValueError(f"memory size must be positive, got {value!r}")
    return size


# A secret does not belong on a command line (other users see it in `ps`): it comes from the
# environment, as hex.
PREFIX_CACHE_KEY_ENV = "TOKENWEIR_PREFIX_CACHE_KEY"


def prefix_cache_key_from_env() -> Optional[bytes]:
    value = os.environ.get(PREFIX_CACHE_KEY_ENV)
    if not value:
        return None
    try:
        return bytes.fromhex(value)
    except ValueError:
        raise ValueError(f"{PREFIX_CACHE_KEY_ENV} must be hex (1 to 64 bytes), got {len(value)} characters "
                         "that are not") from None


def _check_int(name: str, value: object, minimum: int) -> None:
    if not is_integer(value) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_bool(name: str, value: object) -> None:
    # "false" or "no" would be truthy: a switch must be a real bool.
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r}")


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    max_model_len: Optional[int] = None  # None: bounded only by the KV pool
    policy: str = "fcfs"
    enable_chunked_prefill: bool = True
    # A prefill chunk never takes more than this many tokens of a step (0 = no cap), so one long
    # prompt cannot starve the decodes sharing the step.
    long_prefill_token_threshold: int = 0
    # Concurrent partial prefills (vLLM's names; core/prefill_limits.py): with more than 1, at
    # most this many prefills end a step unfinished, and at most max_long_partial_prefills
    # prefills of a step have more than long_prefill_token_threshold tokens left, so short
    # prompts pass long ones. 1 leaves prefills unlimited, as before (vLLM's default, and its
    # convention).
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    # The policy's own knobs (its config_class); None: the policy's defaults.
    policy_config: Optional[PolicyConfig] = None
    # Admission order within the policy's bands (core/composition.py).
    composition: CompositionConfig = field(default_factory=CompositionConfig)
    # Who sets each step's limits (core/batch_controllers.py) and its knobs; the two limits
    # above are then the upper bounds.
    batch_controller: str = "static"
    batch_control_config: Optional[SLOBatchConfig] = None

    def __post_init__(self) -> None:
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 1)
        _check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        _check_int("max_num_partial_prefills", self.max_num_partial_prefills, 1)
        _check_int("max_long_partial_prefills", self.max_long_partial_prefills, 1)
        _check_bool("enable_chunked_prefill", self.enable_chunked_prefill)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}): every running request needs at least one token per step")
        if not isinstance(self.policy, str) or self.policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {sorted(POLICIES)}, got {self.policy!r}")
        expected = POLICIES[self.policy].config_class
        if self.policy_config is not None and type(self.policy_config) is not expected:
            raise ValueError(f"scheduling policy {self.policy!r} takes a {expected.__name__}, "
                             f"got {type(self.policy_config).__name__}")
        if not isinstance(self.composition, CompositionConfig):
            raise ValueError(f"composition must be a CompositionConfig, got {type(self.composition).__name__}")
        check_batch_control(self.batch_controller, self.batch_control_config)
        if self.batch_control_config is not None:
            self.batch_control_config.check_bounds(self.max_num_batched_tokens, self.max_num_seqs)
            if not self.enable_chunked_prefill:
                raise ValueError(f"batch_controller {self.batch_controller!r} lowers the token budget below "
                                 "max_num_batched_tokens, which a prompt must then be chunked to fit: "
                                 "enable chunked prefill")
        if not self.enable_chunked_prefill and self.long_prefill_token_threshold:
            raise ValueError(
                f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) splits prompts into "
                "chunks, but enable_chunked_prefill is off; set it to 0 or enable chunked prefill")
        self._check_partial_prefills()
        if (not self.enable_chunked_prefill and self.max_model_len is not None
                and self.max_num_batched_tokens < self.max_model_len):
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({self.max_model_len}) while enable_chunked_prefill is off: a long prompt could never "
                "be scheduled. Raise max_num_batched_tokens, lower max_model_len or enable chunked prefill.")

    def _check_partial_prefills(self) -> None:
        if self.max_long_partial_prefills > self.max_num_partial_prefills:
            raise ValueError(f"max_long_partial_prefills ({self.max_long_partial_prefills}) must be <= "
                             f"max_num_partial_prefills ({self.max_num_partial_prefills})")
        if self.max_num_partial_prefills == 1:
            return
        if not self.enable_chunked_prefill:
            raise ValueError(f"max_num_partial_prefills ({self.max_num_partial_prefills}) > 1 limits prefills "
                             "that are split across steps, but enable_chunked_prefill is off; enable chunked "
                             "prefill or leave max_num_partial_prefills at 1")
        if self.max_num_partial_prefills > self.max_num_seqs:
            raise ValueError(f"max_num_partial_prefills ({self.max_num_partial_prefills}) must be <= "
                             f"max_num_seqs ({self.max_num_seqs}): no more requests than that run at once")
        if not self.long_prefill_token_threshold and self.max_model_len is not None:
            # vLLM's default: "long" is more than 4% of the context length. (Without max_model_len,
            # as when EngineArgs checks its knobs before the model is known, it is derived later;
            # the scheduler refuses a config that still has none.)
            self.long_prefill_token_threshold = max(1, int(self.max_model_len * 0.04))
        if self.max_model_len is not None and self.long_prefill_token_threshold > self.max_model_len:
            raise ValueError(f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) cannot be "
                             f"greater than max_model_len ({self.max_model_len})")


@dataclass
class CacheConfig:
    block_size: int = 16
    num_blocks: int = 0  # set by the engine from kv_cache_memory / num_gpu_blocks_override
    enable_prefix_caching: bool = True
    watermark: float = 0.0  # fraction of blocks kept free when admitting waiting requests
    preemption_mode: str = "recompute"
    swap_space: float = 0.0  # GiB of host memory for swap preemption
    # Set by the engine: the host tier's blocks (from swap_space) and one block's bytes (all
    # layers, K and V), the size of a swap copy that `auto` prices.
    num_host_blocks: int = 0
    kv_block_bytes: int = 0
    # Secret key of the prefix-cache block keys (core/block_hash.py); replicas of a deployment
    # share it. None: unkeyed BLAKE2b (still unforgeable, but computable from outside).
    prefix_cache_hash_key: Optional[bytes] = None
    # Requests with priority >= this store their K/V in int8 (None: none does), and the tokens a
    # block then holds (set by the engine from the model's head size and dtype).
    int8_kv_min_priority: Optional[int] = None
    int8_block_size: int = 0

    def __post_init__(self) -> None:
        _check_int("block_size", self.block_size, 1)
        threshold = self.int8_kv_min_priority
        if threshold is not None and (not is_integer(threshold) or not PRIORITY_MIN <= threshold <= PRIORITY_MAX):
            raise ValueError(f"the int8 K/V priority threshold must be an integer in [{PRIORITY_MIN}, "
                             f"{PRIORITY_MAX}], got {threshold!r}")
        _check_int("int8_block_size", self.int8_block_size, 0)
        key = self.prefix_cache_hash_key
        if key is not None and (not isinstance(key, bytes) or not 0 < len(key) <= 64):
            raise ValueError(f"the prefix-cache hash key must be 1 to 64 bytes, got {len(key) if isinstance(key, bytes) else key!r}")
        _check_int("num_blocks", self.num_blocks, 0)
        _check_bool("enable_prefix_caching", self.enable_prefix_caching)
        if not is_finite_number(self.watermark) or not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if not is_finite_number(self.swap_space) or self.swap_space < 0:
            raise ValueError(f"swap_space must be a number >= 0 (GiB), got {self.swap_space!r}")
        _check_int("num_host_blocks", self.num_host_blocks, 0)
        _check_int("kv_block_bytes", self.kv_block_bytes, 0)
        if (self.swap_space or self.num_host_blocks) and self.preemption_mode == "recompute":
            what = f"swap_space ({self.swap_space} GiB)" if self.swap_space else f"num_host_blocks ({self.num_host_blocks})"
            raise ValueError(f"{what} would never be used: preemption_mode 'recompute' does not swap; "
                             "leave swap_space at 0")
        if self.preemption_mode != "recompute" and not (self.swap_space or self.num_host_blocks):
            raise ValueError(f"preemption_mode {self.preemption_mode!r} swaps to host memory, but swap_space "
                             "is 0; give swap_space (GiB) or use preemption_mode 'recompute'")

    @property
    def watermark_blocks(self) -> int:
        return int(self.watermark * self.num_blocks)


_SLA = SLAConfig()  # the defaults of the policy knobs below
_VTC = VTCConfig()
_COMPOSITION = CompositionConfig()
_SLO_BATCH = SLOBatchConfig(target_tpot_ms=1.0)  # the defaults of the slo batch knobs


def _slo_batch_field(name: str, help_text: str) -> object:
    """An engine arg for SLOBatchConfig.<name>: None unless set (it is refused with `static`),
    documented with its default there."""
    return field(default=None, metadata={"help": f"slo: {help_text} (default {getattr(_SLO_BATCH, name)})"})


def _sla_field(name: str, help_text: str, shown_default: object = None) -> object:
    """An engine arg `sla_<name>`: None unless set, so that it is refused with another policy
    whatever its value, SLAConfig's default too (that default, the one place for it, fills in
    where it is not set). The help shows that default, or `shown_default` where SLAConfig's
    own is None for "not given"."""
    default = getattr(_SLA, name)
    shown = default if shown_default is None else shown_default
    return field(default=None, metadata={"help": f"{help_text} (default {shown})"})


@dataclass
class EngineArgs:
    """All engine knobs, named as in vLLM (`--max-num-batched-tokens` on the CLI)."""

    model: Optional[str] = field(default=None, metadata={
        "help": "HF folder or GGUF file (default: the embedded SmolLM2-135M-Instruct)"})
    served_model_name: Optional[str] = field(default=None, metadata={
        "help": "model name in the API (default: the folder or file name)"})
    dtype: str = field(default="auto", metadata={
        "help": "auto | float32 | bfloat16 | float16 (auto: bf16 where the CPU runs it fast)"})
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda"})
    generation_config: str = field(default="auto", metadata={
        "help": "auto: the model folder's generation_config.json sets the default temperature, top_p, top_k, "
                "min_p and repetition_penalty of requests that leave them unset (as vLLM); vllm: ignore it"})
    seed: int = field(default=0, metadata={"help": "seed of the model's random state"})
    max_model_len: Optional[int] = field(default=None, metadata={
        "help": "context length per request (default: the model's, capped to the KV pool)"})
    max_num_batched_tokens: Optional[int] = field(default=None, metadata={
        "help": "token budget of one step (default 2048; without chunked prefill, max(2048, max_model_len))"})
    max_num_seqs: Optional[int] = field(default=None, metadata={
        "help": "maximum number of running requests (default 256, or the token budget if smaller)"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "reuse KV blocks of shared prompt prefixes"})
    enable_chunked_prefill: bool = field(default=True, metadata={"help": "split long prompts across steps"})
    long_prefill_token_threshold: int = field(default=0, metadata={
        "help": "cap on one prefill chunk's tokens per step (0 = off), and what counts as a long prompt "
                "for --max-long-partial-prefills (0 there: 4%% of max_model_len)"})
    max_num_partial_prefills: int = field(default=1, metadata={
        "help": "prefills that may end a step unfinished (1 = unlimited, as in vLLM); above 1, long prompts "
                "are limited by --max-long-partial-prefills and shorter ones may pass them"})
    max_long_partial_prefills: int = field(default=1, metadata={
        "help": "prefills per step with more than --long-prefill-token-threshold tokens left (<= "
                "--max-num-partial-prefills)"})
    scheduling_policy: str = field(default="fcfs", metadata={
        "help": "fcfs | priority | sla (adaptive score) | vtc (per-tenant fair share)"})
    # --- sla: score = -priority*base + urgency*load_adj*urgency_w - resource*resource_w + fairness + aging
    sla_base_weight: Optional[float] = _sla_field(
        "base_weight", "sla: score per priority level (smaller priority first)")
    sla_urgency_weight: Optional[float] = _sla_field(
        "urgency_weight", "sla: weight of urgency, a sigmoid of (now - due time) / sla_time_window")
    sla_time_window: Optional[float] = _sla_field("time_window", "sla: seconds, the urgency sigmoid's scale")
    sla_resource_weight: Optional[float] = _sla_field(
        "resource_weight", "sla: weight of log(prompt + max_tokens) / sla_resource_scale, subtracted (short first)")
    sla_resource_scale: Optional[float] = _sla_field("resource_scale", "sla: divides the log of the request's tokens")
    sla_load_threshold: Optional[float] = _sla_field(
        "load_threshold", "sla: load at which urgency weighs x1; load = max(share of unfinished requests "
                          "waiting, sla_kv_load_weight x KV cache usage)")
    sla_load_sensitivity: Optional[float] = _sla_field(
        "load_sensitivity", "sla: urgency's load adjustment is 1 + (load - threshold) * sensitivity")
    sla_kv_load_weight: Optional[float] = _sla_field(
        "kv_load_weight", "sla: weight in [0, 1] of KV cache usage in the load (0: queue depth only)")
    sla_fairness_factor: Optional[float] = _sla_field(
        "fairness_factor", "sla: boost per share point a priority class is served below 0.8x its demand share")
    sla_fairness_window: Optional[float] = _sla_field("fairness_window", "sla: seconds over which class shares decay")
    sla_aging_rate: Optional[float] = _sla_field("aging_rate", "sla: score per second waited")
    sla_max_wait: Optional[float] = _sla_field(
        "max_wait", "sla: seconds after which a waiting request goes before every younger one (wait bound)")
    sla_preempt_margin: Optional[float] = _sla_field(
        "preempt_margin", "sla: a waiting request preempts only a running one scored this much lower (hysteresis)")
    sla_max_preemptions: Optional[int] = _sla_field(
        "max_preemptions", "sla: a request preempted this many times is not preempted again for another")
    sla_drop_expired: Optional[bool] = _sla_field(
        "drop_expired", "sla: finish requests whose deadline_ms has passed (error 504 deadline_exceeded)")
    sla_drop_unmeetable: Optional[bool] = _sla_field(
        "drop_unmeetable", "sla: also finish requests whose deadline_ms cannot be met, by the step cost model "
                           "(sla_cost_profile, scaled by measured step times): even served alone from now "
                           "(remaining prefill in one step, then a decode step per token it must still sample: "
                           "min_tokens, or max_tokens with ignore_eos and no stops), sla_unmeetable_margin x "
                           "that time exceeds the time left (504 deadline_exceeded). An estimate of a fitted "
                           "model, not a proof; sheds expired requests too. With sla_step_time_correction "
                           f"nothing is judged before {LOW_RATIO_MIN_STEPS} steps were measured (a fresh engine's "
                           "first steps may be a slow warm-up): until then only passed deadlines are shed")
    sla_unmeetable_margin: Optional[float] = _sla_field(
        "unmeetable_margin", "sla: in (0, 1), the share of the cost model's lower bound that must still not fit "
                             "before --sla-drop-unmeetable sheds a request (its slack for the model's error); "
                             "refused without it", shown_default=UNMEETABLE_MARGIN)
    sla_protect_slos: Optional[bool] = _sla_field(
        "protect_slos", "sla: keep a less important prefill out of a step that would make a more important "
                        "running request miss its TTFT or TPOT SLO (step times from sla_cost_profile)")
    sla_cost_profile: Optional[str] = _sla_field(
        "cost_profile", "sla: step cost profile (tokenweir profile) for --sla-protect-slos; default: the shipped CPU one")
    sla_step_time_correction: Optional[bool] = _sla_field(
        "step_time_correction", "sla: scale the SLO guard's predicted step times by the running ratio of measured to "
                                "predicted step periods (a profile of another machine, or a busier one)")
    sla_tenant_fairness: Optional[bool] = _sla_field(
        "tenant_fairness", "sla: within a priority class, serve tenants by virtual token counters (VTC)")
    num_priority_classes: int = field(default=_SLA.num_priority_classes, metadata={
        "help": "priority classes (priority clamped to [0, n-1]) for sla fairness and per-class metrics "
                f"(default {_SLA.num_priority_classes})"})
    # --- vtc (alone, or sla's tenant term)
    # None unless set, as the sla knobs above: refused without vtc, whatever the value.
    vtc_input_weight: Optional[float] = field(default=None, metadata={
        "help": f"vtc: counter units per prompt token computed (default {_VTC.input_weight})"})
    vtc_output_weight: Optional[float] = field(default=None, metadata={
        "help": f"vtc: counter units per generated token (default {_VTC.output_weight})"})
    vtc_tenant_weights: Optional[str] = field(default=None, metadata={
        "help": "vtc: tenant shares, 'a=2,b=1' or @file.json ({tenant: weight}); others weigh 1"})
    # --- batch composition (core/composition.py)
    admission_order: Union[str, tuple[str, ...], list[str]] = field(default=_COMPOSITION.admission_order, metadata={
        "help": f"order of admission within the policy's bands (fcfs: all; priority: equal priority; vtc: "
                f"the tenant served next; sla: none): {' | '.join(ADMISSION_ORDERS)}, or several of those but "
                f"policy joined by commas (cache-aware,sampling-grouped: the first decides, the next ones "
                f"break its ties) (default {_COMPOSITION.admission_order})"})
    # These two are None unless set: refused with the `policy` order, whatever the value.
    admission_max_wait: Optional[float] = field(default=None, metadata={
        "help": "seconds after which a waiting request is passed by no later arrival of its band "
                f"(the aging bound of the admission orders; default {_COMPOSITION.max_wait})"})
    admission_window: Optional[int] = field(default=None, metadata={
        "help": f"requests of a band an admission order chooses among (default {_COMPOSITION.window})"})
    # --- batch control: who sets each step's token budget and sequence cap
    batch_controller: str = field(default="static", metadata={
        "help": "static (the max_* limits) | slo (adapts both within [min, max] to keep the windowed "
                "p99 ITL/TPOT under --target-tpot-ms; the max_* limits are the upper bounds)"})
    target_tpot_ms: Optional[float] = field(default=None, metadata={
        "help": "slo: target of the windowed p99 of inter-token latency / TPOT, ms (required with slo)"})
    target_ttft_ms: Optional[float] = field(default=None, metadata={
        "help": "slo: optional target of the windowed p99 TTFT, ms: over it, steps leave more room to prefill"})
    min_num_batched_tokens: Optional[int] = field(default=None, metadata={
        "help": f"slo: lowest token budget, kept even where a full step of it misses the target (a warning "
                f"says so); default {DEFAULT_MIN_NUM_BATCHED_TOKENS}, which yields to the target and to a "
                f"smaller max_num_batched_tokens"})
    min_num_seqs: Optional[int] = _slo_batch_field("min_num_seqs", "lowest sequence cap")
    initial_num_batched_tokens: Optional[int] = field(default=None, metadata={
        "help": "slo: token budget until the first adjustment (default: the cost model's choice)"})
    initial_num_seqs: Optional[int] = field(default=None, metadata={
        "help": "slo: sequence cap until the first adjustment (default: the cost model's choice)"})
    batch_control_window: Optional[float] = _slo_batch_field("window", "seconds of steps the p99 is taken over")
    batch_control_interval: Optional[float] = _slo_batch_field("interval", "seconds between adjustments")
    batch_control_hysteresis: Optional[float] = _slo_batch_field(
        "hysteresis", "share below the target where nothing changes, and the least relative move of a limit")
    batch_control_hold: Optional[str] = _slo_batch_field(
        "hold", "what is held under --target-tpot-ms: itl (every step's period, the windowed p99 of ITL) or "
                "tpot (each request's TPOT: a step may outlast the target while every row has the slack)")
    batch_control_cost_profile: Optional[str] = field(default=None, metadata={
        "help": "slo: step cost profile (tokenweir profile --serving) its predictions start from, scaled by "
                "measured step times (default: the shipped CPU one)"})
    preemption_mode: str = field(default="recompute", metadata={
        "help": "recompute | swap | auto (per victim, by predicted cost; swap needs --swap-space)"})
    low_priority_kv_cache_dtype: str = field(default="auto", metadata={
        "help": "auto (every request's K/V in the model's dtype) | int8: requests with priority >= "
                "--low-priority-threshold store theirs in int8 with a scale per 32 channels of a token and head, 1.75x "
                "the tokens per block for bf16 (the others are computed exactly as before)"})
    low_priority_threshold: Optional[int] = field(default=None, metadata={
        "help": f"with --low-priority-kv-cache-dtype int8: the least priority value compressed (larger is less "
                f"important; default {DEFAULT_LOW_PRIORITY_THRESHOLD})"})
    watermark: float = field(default=0.0, metadata={
        "help": "fraction of KV blocks kept free when admitting new requests"})
    swap_space: float = field(default=0.0, metadata={"help": "GiB of host memory for swap preemption"})
    num_gpu_blocks_override: Optional[int] = field(default=None, metadata={
        "help": "number of KV blocks (instead of --kv-cache-memory)"})
    kv_cache_memory: Union[None, int, str] = field(default=None, metadata={
        "help": "KV cache size, e.g. 2GiB (CPU default 2GiB)"})
    gpu_memory_utilization: float = field(default=0.9, metadata={
        "help": "CUDA: fraction of the GPU's memory the engine may use (weights, activations, KV)"})
    disable_log_stats: bool = field(default=False, metadata={"help": "do not log periodic engine stats"})

    def __post_init__(self) -> None:
        # The scheduler core takes any block size; the model's KV cache stores keys and values
        # in pairs (attention.py), so the engine needs an even one.
        _check_bool("disable_log_stats", self.disable_log_stats)
        if self.generation_config not in GENERATION_CONFIGS:
            raise ValueError(f"generation_config must be one of {', '.join(GENERATION_CONFIGS)}, "
                             f"got {self.generation_config!r}")
        if not is_finite_number(self.gpu_memory_utilization) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if not is_integer(self.block_size) or self.block_size < 2 or self.block_size % 2:
            raise ValueError(f"block_size must be a positive even number of tokens, got {self.block_size!r}")
        if self.num_gpu_blocks_override is not None:
            _check_int("num_gpu_blocks_override", self.num_gpu_blocks_override, 1)
            if self.kv_cache_memory is not None:
                raise ValueError(
                    f"num_gpu_blocks_override ({self.num_gpu_blocks_override}) and kv_cache_memory "
                    f"({self.kv_cache_memory!r}) both size the KV pool; set only one of them")
        # One spelling of the order, however it was given (a tuple, "a, b"): engine_argv passes
        # it on as a flag, and equal orders compare equal.
        self.admission_order = CompositionConfig(self.admission_order).admission_order
        # Check every knob the model does not decide now, before a model is loaded for nothing.
        self._scheduler_and_cache_configs(self.max_model_len, num_blocks=0)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def create_engine_configs(
        self, model_max_len: int, num_blocks: int, *, num_host_blocks: int = 0, kv_block_bytes: int = 0,
        int8_block_size: int = 0,
    ) -> tuple[CacheConfig, SchedulerConfig]:
        """Resolve defaults against the model (its context length, and with int8 K/V the tokens an
        int8 block holds) and the KV pools' sizes."""
        capacity = num_blocks * self.block_size
        # Unset, max_model_len is the model's context, shrunk to what the pool holds (a small
        # CPU pool should still serve); set explicitly, it must fit both.
        max_model_len = self.max_model_len or min(model_max_len, capacity)
        if max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len ({max_model_len}) exceeds the model's context length ({model_max_len})")
        if max_model_len > capacity:
            raise ValueError(
                f"max_model_len ({max_model_len}) is larger than the KV cache can hold ({num_blocks} "
                f"blocks x {self.block_size} = {capacity} tokens); raise kv_cache_memory / "
                "num_gpu_blocks_override or lower max_model_len")
        cache, scheduler = self._scheduler_and_cache_configs(max_model_len, num_blocks)
        if cache.int8_kv_min_priority is not None and int8_block_size < 2:
            raise ValueError("low_priority_kv_cache_dtype 'int8' needs the tokens an int8 block holds, got "
                             f"{int8_block_size}")
        return replace(cache, num_host_blocks=num_host_blocks, kv_block_bytes=kv_block_bytes,
                       int8_block_size=int8_block_size), scheduler

    def _scheduler_and_cache_configs(self, max_model_len: Optional[int],
                                     num_blocks: int) -> tuple[CacheConfig, SchedulerConfig]:
        if self.max_num_batched_tokens is not None:
            budget = self.max_num_batched_tokens
        else:
            budget = 2048 if self.enable_chunked_prefill else max(2048, max_model_len or 0)
        cache = CacheConfig(block_size=self.block_size, num_blocks=num_blocks,
                            prefix_cache_hash_key=prefix_cache_key_from_env(),
                            enable_prefix_caching=self.enable_prefix_caching, watermark=self.watermark,
                            preemption_mode=self.preemption_mode, swap_space=self.swap_space,
                            int8_kv_min_priority=self._int8_kv_min_priority())
        max_num_seqs = self.max_num_seqs if self.max_num_seqs is not None else min(256, budget)
        scheduler = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                                    max_model_len=max_model_len, policy=self.scheduling_policy,
                                    enable_chunked_prefill=self.enable_chunked_prefill,
                                    long_prefill_token_threshold=self.long_prefill_token_threshold,
                                    max_num_partial_prefills=self.max_num_partial_prefills,
                                    max_long_partial_prefills=self.max_long_partial_prefills,
                                    policy_config=self._policy_config(),
                                    composition=self._composition(),
                                    batch_controller=self.batch_controller,
                                    batch_control_config=self._batch_control_config())
        return cache, scheduler

    def _int8_kv_min_priority(self) -> Optional[int]:
        if self.low_priority_kv_cache_dtype not in LOW_PRIORITY_KV_CACHE_DTYPES:
            raise ValueError(f"low_priority_kv_cache_dtype must be one of {', '.join(LOW_PRIORITY_KV_CACHE_DTYPES)}, "
                             f"got {self.low_priority_kv_cache_dtype!r}")
        if self.low_priority_kv_cache_dtype == "auto":
            if self.low_priority_threshold is not None:
                raise ValueError("low_priority_threshold only applies to low_priority_kv_cache_dtype 'int8'")
            return None
        threshold = self.low_priority_threshold
        if threshold is None:
            return DEFAULT_LOW_PRIORITY_THRESHOLD
        if not is_integer(threshold) or not PRIORITY_MIN <= threshold <= PRIORITY_MAX:
            raise ValueError(f"low_priority_threshold must be an integer priority in [{PRIORITY_MIN}, "
                             f"{PRIORITY_MAX}], got {threshold!r}")
        return threshold

    _SLO_BATCH_ARGS = {"min_num_batched_tokens": "min_num_batched_tokens", "min_num_seqs": "min_num_seqs",
                       "initial_num_batched_tokens": "initial_num_batched_tokens",
                       "initial_num_seqs": "initial_num_seqs", "batch_control_window": "window",
                       "batch_control_interval": "interval", "batch_control_hysteresis": "hysteresis",
                       "target_ttft_ms": "target_ttft_ms", "batch_control_cost_profile": "cost_profile",
                       "batch_control_hold": "hold"}

    def _batch_control_config(self) -> Optional[SLOBatchConfig]:
        given = {arg: getattr(self, arg) for arg in ("target_tpot_ms", *self._SLO_BATCH_ARGS)
                 if getattr(self, arg) is not None}
        if self.batch_controller != "slo":
            if given:
                raise ValueError(f"{', '.join(given)} only {'applies' if len(given) == 1 else 'apply'} to "
                                 "batch_controller 'slo', "
                                 f"not {self.batch_controller!r}")
            return None
        if self.target_tpot_ms is None:
            raise ValueError("batch_controller 'slo' needs target_tpot_ms (the p99 ITL/TPOT to keep under)")
        # The default minimum budget (None here) yields to a smaller maximum and to the target;
        # one the user gave is checked against the maximum. (The default minimum cap, 1, fits any.)
        knobs = {knob: given[arg] for arg, knob in self._SLO_BATCH_ARGS.items() if arg in given}
        return SLOBatchConfig(target_tpot_ms=self.target_tpot_ms, **knobs)

    _COMPOSITION_ARGS = {"admission_max_wait": "max_wait", "admission_window": "window"}

    def _composition(self) -> CompositionConfig:
        """The admission order, refused where it could do nothing (a silent no-op flag would be
        taken for one that works)."""
        # None is "not given" (CompositionConfig's defaults fill in), so a bound given at the
        # default's value is refused with `policy` as any other is.
        given = {arg: getattr(self, arg) for arg in self._COMPOSITION_ARGS if getattr(self, arg) is not None}
        composition = CompositionConfig(self.admission_order,
                                        **{self._COMPOSITION_ARGS[arg]: value for arg, value in given.items()})
        order = composition.admission_order
        if order == _COMPOSITION.admission_order and given:
            raise ValueError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only to an "
                             f"admission_order other than {order!r}")
        check_admission_order(composition, self.scheduling_policy, self.enable_prefix_caching)
        return composition

    def _policy_config(self) -> Optional[PolicyConfig]:
        """The knobs of the chosen policy (None: a policy without knobs takes its defaults).
        A knob is given when it is not None, whatever its value: one given where it does
        nothing is refused, and the configs' defaults fill in those not given."""
        sla_given = {k: getattr(self, f"sla_{k}") for k in (f.name for f in fields(SLAConfig))
                     if k not in ("num_priority_classes", "vtc") and getattr(self, f"sla_{k}") is not None}
        if self.scheduling_policy != "sla" and sla_given:
            raise ValueError(f"{', '.join(f'sla_{k}' for k in sla_given)} only "
                             f"{'applies' if len(sla_given) == 1 else 'apply'} to scheduling_policy 'sla', "
                             f"not {self.scheduling_policy!r}")
        vtc_given = {k: getattr(self, f"vtc_{k}") for k in ("input_weight", "output_weight", "tenant_weights")
                     if getattr(self, f"vtc_{k}") is not None}
        if vtc_given and not (self.scheduling_policy == "vtc"
                              or (self.scheduling_policy == "sla" and sla_given.get("tenant_fairness"))):
            raise ValueError(f"{', '.join(f'vtc_{k}' for k in vtc_given)} "
                             f"{'applies' if len(vtc_given) == 1 else 'apply'} only to scheduling_policy 'vtc', "
                             f"or 'sla' with sla_tenant_fairness, not {self.scheduling_policy!r}"
                             + (" without it" if self.scheduling_policy == "sla" else ""))
        if self.scheduling_policy not in ("sla", "vtc"):
            return None
        if "tenant_weights" in vtc_given:
            vtc_given["tenant_weights"] = parse_tenant_weights(vtc_given["tenant_weights"])
        vtc = VTCConfig(**vtc_given)
        if self.scheduling_policy == "vtc":
            return vtc
        return SLAConfig(**sla_given, num_priority_classes=self.num_priority_classes, vtc=vtc)

    def num_host_blocks(self, kv_block_bytes: int) -> int:
        """Blocks of `kv_block_bytes` that swap_space holds (the engine's and the simulator's)."""
        num_blocks = int(self.swap_space * 1024**3) // kv_block_bytes
        if self.swap_space and num_blocks < 1:
            raise ValueError(f"swap_space of {self.swap_space} GiB holds no KV block of {kv_block_bytes} bytes")
        return num_blocks

    def kv_cache_bytes(self) -> Optional[int]:
        return None if self.kv_cache_memory is None else parse_size(self.kv_cache_memory)


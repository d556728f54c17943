"""The command line: flags named as in vLLM, and `tokenweir generate` on the default model."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tokenweir.cli import build_parser, engine_args_from


def test_engine_flags_follow_vllm_names():
    ns = build_parser().parse_args([
        "serve", "--max-num-batched-tokens", "512", "--max-num-seqs", "8", "--block-size", "32",
        "--no-enable-prefix-caching", "--scheduling-policy", "priority", "--max-model-len", "1024",
        "--kv-cache-memory", "1GiB", "--port", "9001", "--api-key", "k", "--max-waiting-requests", "4"])
    args = engine_args_from(ns)
    assert (args.max_num_batched_tokens, args.max_num_seqs, args.block_size) == (512, 8, 32)
    assert args.enable_prefix_caching is False and args.scheduling_policy == "priority"
    assert args.max_model_len == 1024 and args.kv_cache_bytes() == 1024**3 and args.model is None
    assert (ns.port, ns.api_key, ns.max_waiting_requests, ns.host) == (9001, "k", 4, "127.0.0.1")


def test_generate_prints_a_completion_from_the_default_model():
    result = subprocess.run(
        [sys.executable, "-m", "tokenweir.cli", "generate", "What is the capital of France?",
         "--max-tokens", "12", "--num-gpu-blocks-override", "64"],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@pytest.mark.parametrize("flags, message", [
    (["--block-size", "15"], "error: block_size must be a positive even number of tokens, got 15"),
    (["--model", "/no/such/model"], "/no/such/model"),
    # Checked before the model loads (a missing model would fail first otherwise).
    (["--model", "/no/such/model", "--max-tokens", "0"], "max_tokens must be an integer >= 1"),
])
def test_a_bad_setting_is_a_one_line_error_not_a_traceback(flags, message):
    result = subprocess.run([sys.executable, "-m", "tokenweir.cli", "generate", "hi", *flags],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("tokenweir: error: ") and message in last


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_engine_field_is_a_flag_with_its_help(command):
    import dataclasses

    from tokenweir.config import EngineArgs

    import typing

    sub = build_parser()._subparsers._group_actions[0].choices[command]
    actions = {option: action for action in sub._actions for option in action.option_strings}
    defaults = EngineArgs()
    hints = typing.get_type_hints(EngineArgs)
    for f in dataclasses.fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        assert flag in actions, flag
        assert f.metadata.get("help") and actions[flag].help == f.metadata["help"], flag
        assert actions[flag].default == getattr(defaults, f.name)
        # vLLM's switches: --enable-x / --no-enable-x (those None until given too, as --sla-drop-expired)
        if bool in (hints[f.name], *typing.get_args(hints[f.name])):
            assert "--no-" + flag[2:] in actions[flag].option_strings, flag
    assert "--max-model-len" in sub.format_help() and "--no-enable-prefix-caching" in sub.format_help()


def test_flag_types_follow_the_field_annotations():
    ns = build_parser().parse_args(["generate", "hi", "--max-model-len", "64", "--watermark", "0.25",
                                    "--kv-cache-memory", "2GiB", "--dtype", "float32", "--no-enable-chunked-prefill"])
    args = engine_args_from(ns)
    assert args.max_model_len == 64 and args.watermark == 0.25 and args.kv_cache_memory == "2GiB"
    assert args.dtype == "float32" and args.enable_chunked_prefill is False
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-num-seqs", "many"])


def _generate_on(model_dir: str, level: str) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [sys.executable, "-m", "tokenweir.cli", "generate", "hi", "--no-chat", "--max-tokens", "2",
         "--model", model_dir, "--device", "cpu", "--dtype", "float32", "--num-gpu-blocks-override", "16",
         "--scheduling-policy", "sla"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "TOKENWEIR_LOGGING_LEVEL": level})


def test_the_logging_level_variable_turns_on_the_sla_score_parts(tiny_model_dir):
    """TOKENWEIR_LOGGING_LEVEL (as vLLM's VLLM_LOGGING_LEVEL) is read by configure_logging, so
    the engine process of `serve`, spawned with the same environment, honours it too."""
    import re

    result = _generate_on(tiny_model_dir("llama"), "debug")
    assert result.returncode == 0, result.stderr
    # The policy explains each request whose turn it is, with its score's parts.
    assert re.search(r"^DEBUG .* tokenweir\.sla: sla t=\d+\.\d{3} load=\d+\.\d{2} next \S+: \{'base': .*'urgency': ",
                     result.stderr, re.MULTILINE), result.stderr[-2000:]


def test_a_bad_logging_level_is_a_clear_error(tiny_model_dir):
    result = _generate_on(tiny_model_dir("llama"), "LOUD")
    # One line, as for a bad flag (no traceback).
    assert result.returncode == 2 and result.stderr.strip() == (
        "tokenweir: error: TOKENWEIR_LOGGING_LEVEL must be one of DEBUG, INFO, WARNING, ERROR, CRITICAL, "
        "got 'LOUD'")


# A knob given at its default's value where it does nothing is refused as any other value is,
# by every command that takes engine flags. Each command line would fail fast on something
# else, after the engine args, were the knob accepted (a missing model, keys file, profile).
COMMANDS = {"generate": ["generate", "hi", "--model", "/no/such/model"],
            "serve": ["serve", "--api-keys-file", "/no/such/keys"],
            "simulate": ["simulate", "--profile", "/no/such/profile.json"]}
KNOBS_AT_DEFAULT = [
    (["--scheduling-policy", "fcfs", "--sla-base-weight", "10"],
     "sla_base_weight only applies to scheduling_policy 'sla', not 'fcfs'"),
    (["--scheduling-policy", "vtc", "--no-sla-drop-expired"],
     "sla_drop_expired only applies to scheduling_policy 'sla', not 'vtc'"),
    (["--scheduling-policy", "fcfs", "--vtc-output-weight", "2"],
     "vtc_output_weight applies only to scheduling_policy 'vtc', or 'sla' with sla_tenant_fairness, not 'fcfs'"),
    (["--scheduling-policy", "sla", "--no-sla-tenant-fairness", "--vtc-input-weight", "1"],
     "vtc_input_weight applies only to scheduling_policy 'vtc', or 'sla' with sla_tenant_fairness, not 'sla' "
     "without it"),
    (["--admission-max-wait", "30"], "admission_max_wait applies only to an admission_order other than 'policy'"),
    (["--admission-order", "policy", "--admission-window", "32"],
     "admission_window applies only to an admission_order other than 'policy'"),
]


@pytest.mark.parametrize("flags, message", KNOBS_AT_DEFAULT)
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_knob_given_at_its_default_where_it_does_nothing_is_a_one_line_error(command, flags, message, capsys):
    from tokenweir.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main([*COMMANDS[command], *flags])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"tokenweir: error: {message}"


def test_knobs_given_at_their_defaults_with_their_policy_are_kept_and_yield_the_defaults():
    from tokenweir.cli import engine_argv
    from tokenweir.core.composition import CompositionConfig
    from tokenweir.core.policies import SLAConfig, VTCConfig

    def parsed(*flags: str):
        return engine_args_from(build_parser().parse_args(["serve", *flags]))

    def configs(args):
        return args.create_engine_configs(2048, 64)[1]

    sla = parsed("--scheduling-policy", "sla", "--sla-base-weight", "10", "--no-sla-drop-expired")
    assert configs(sla).policy_config == SLAConfig() == configs(parsed("--scheduling-policy", "sla")).policy_config
    # Passed on as given (serve's engine process, profile's servers), so refused there alike.
    assert engine_argv(sla) == ["--scheduling-policy", "sla", "--sla-base-weight", "10.0", "--no-sla-drop-expired"]
    assert parsed(*engine_argv(sla)) == sla
    vtc = parsed("--scheduling-policy", "vtc", "--vtc-input-weight", "1", "--vtc-output-weight", "2")
    assert configs(vtc).policy_config == VTCConfig()
    order = parsed("--admission-order", "cache-aware", "--admission-max-wait", "30", "--admission-window", "32")
    assert configs(order).composition == CompositionConfig("cache-aware")


@pytest.mark.parametrize("chat", [True, False])
def test_generate_sends_its_priority(tiny_model_dir, monkeypatch, capsys, chat):
    """`--priority` reaches the request (with int8 K/V from --low-priority-threshold on, it
    decides the request's K/V dtype), through chat and plain prompts alike."""
    from tokenweir import cli
    from tokenweir.engine.core import EngineCore

    seen = []
    add_request = EngineCore.add_request

    def spy(self, request_id, prompt, params, hints, **kwargs):
        request = add_request(self, request_id, prompt, params, hints, **kwargs)
        seen.append((hints.priority, request.kv_int8))
        return request

    monkeypatch.setattr(EngineCore, "add_request", spy)
    assert cli.main(["generate", "hi", "--chat" if chat else "--no-chat", "--max-tokens", "2",
                     "--model", tiny_model_dir("llama"), "--device", "cpu", "--dtype", "float32",
                     "--num-gpu-blocks-override", "16", "--low-priority-kv-cache-dtype", "int8",
                     "--priority", "3"]) == 0
    assert seen == [(3, True)]

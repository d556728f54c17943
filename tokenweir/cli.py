"""`tokenweir serve | generate | profile | simulate [search] | bench serve`. Engine flags use vLLM's names (--max-num-seqs)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import typing
from typing import Any, Optional, Sequence

from tokenweir.config import EngineArgs

def _flag_type(annotation: Any) -> Any:
    """The argparse type of an EngineArgs field: its annotation without None; where a field also
    takes a string (kv_cache_memory: "2GiB"), the string, which the field parses itself."""
    kinds = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    return str if str in kinds else kinds[0]


def add_engine_args(parser: argparse.ArgumentParser, sweep: bool = False,
                    skip: frozenset[str] = frozenset()) -> None:
    """One flag per EngineArgs field, with the field's type, default and help, so the flags
    cannot drift from the dataclass. Switches take vLLM's form: --enable-x / --no-enable-x.
    With `sweep`, every other flag takes a comma-separated list of values to try. Fields in
    `skip` get no flag (their default is used)."""
    hints = typing.get_type_hints(EngineArgs)
    defaults = EngineArgs()  # also right for fields with a default_factory
    group = parser.add_argument_group("engine" + (" (comma-separated values are swept)" if sweep else ""))
    for f in dataclasses.fields(EngineArgs):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = _flag_type(hints[f.name])
        default, help_text = getattr(defaults, f.name), f.metadata.get("help", "")
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        elif sweep:
            group.add_argument(flag, type=_sweep_type(kind, flag), default=[default], help=help_text)
        else:
            group.add_argument(flag, type=kind, default=default, help=help_text)


def _sweep_type(kind: Any, flag: str) -> Any:
    # Values are split on ";" when the text has one, else on ",": a value whose own syntax has
    # commas (`--admission-order cache-aware,sampling-grouped`, `--vtc-tenant-weights a=2,b=1`)
    # is then swept as one value.
    def parse(text: str) -> list[Any]:
        try:
            return [kind(v.strip()) for v in text.split(";" if ";" in text else ",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes comma-separated {kind.__name__} values "
                                             f"(or ';'-separated ones), got {text!r}") from None
    return parse


def engine_argv(args: EngineArgs) -> list[str]:
    """The flags that make `add_engine_args` parse back to `args` (those that differ from the
    defaults), to start another tokenweir process with the same engine."""
    defaults = EngineArgs()
    argv: list[str] = []
    for f in dataclasses.fields(EngineArgs):
        value = getattr(args, f.name)
        if value == getattr(defaults, f.name):
            continue
        flag = f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(f"--{flag}" if value else f"--no-{flag}")
        elif value is None:
            raise ValueError(f"engine arg {f.name} cannot be unset from the command line")
        else:
            argv += [f"--{flag}", str(value)]
    return argv


def engine_args_from(ns: argparse.Namespace, skip: frozenset[str] = frozenset()) -> EngineArgs:
    return EngineArgs(**{name: getattr(ns, name) for name in EngineArgs.field_names() if name not in skip})


def engine_sweep_from(ns: argparse.Namespace) -> tuple[EngineArgs, dict[str, list[Any]]]:
    """The base args (single values) and the swept ones (flags given several values)."""
    values = {name: getattr(ns, name) for name in EngineArgs.field_names() if name not in SIM_SKIPPED_ENGINE_ARGS}
    lists = {k: v for k, v in values.items() if isinstance(v, list) and len(v) > 1}
    base = {k: (v[0] if isinstance(v, list) else v) for k, v in values.items()}
    return EngineArgs(**base), lists


def _generate(ns: argparse.Namespace) -> int:
    from tokenweir.engine.llm import LLM
    from tokenweir.request import SamplingParams

    # Both checked before the model loads: a bad flag fails in a moment, not after the load.
    args = engine_args_from(ns)
    given = {name: value for name, value in (("temperature", ns.temperature), ("top_p", ns.top_p)) if value is not None}
    SamplingParams(max_tokens=ns.max_tokens, seed=ns.seed_sampling, **given)
    llm = LLM(**dataclasses.asdict(args))
    # The model's defaults (--generation-config auto) for what the flags leave unset; greedy
    # unless --temperature is given, whatever the model's file says (the command's default).
    params = dataclasses.replace(llm.get_default_sampling_params(), max_tokens=ns.max_tokens, seed=ns.seed_sampling,
                                 **{"temperature": 0.0, **given})
    if ns.chat:
        outputs = llm.chat([{"role": "user", "content": ns.prompt}], params, use_tqdm=False, priority=ns.priority)
    else:
        outputs = llm.generate(ns.prompt, params, use_tqdm=False, priority=ns.priority)
    print(outputs[0].outputs[0].text)
    return 0


def _serve(ns: argparse.Namespace) -> int:
    from tokenweir.engine.serving_threads import reserve_core_for_serving
    from tokenweir.server.app import run_server

    if ns.engine_in_process:  # an engine process of its own has its cores to itself
        reserve_core_for_serving()
    run_server(engine_args_from(ns), ns)
    return 0


def _profile(ns: argparse.Namespace) -> int:
    from tokenweir.profiling import profile

    return profile.main(ns, engine_args_from(ns))


# Engine flags `simulate` does not take: --seed is the workload's seed there (as in `bench
# serve`; simulated tokens are not sampled from a model), and the model, its dtype and device
# and the GPU memory share are the profile's (take a profile of another model to simulate it).
SIM_SKIPPED_ENGINE_ARGS = frozenset({"seed", "model", "served_model_name", "dtype", "device",
                                     "gpu_memory_utilization"})


def _simulate(ns: argparse.Namespace) -> int:
    if ns.simulate_command == "search":
        from tokenweir.sim import search

        base, lists = engine_sweep_from(ns)
        search.main(ns, base, lists)
    else:
        from tokenweir.sim import run

        run.main(ns, engine_args_from(ns, SIM_SKIPPED_ENGINE_ARGS))
    return 0


class _ProfileDecides(argparse.Action):
    """An engine flag whose value the cost profile fixes in `simulate`: refused, with why."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: Optional[str] = None) -> None:
        parser.error(f"{option_string}: the simulated engine's model, dtype, device and GPU memory share are the "
                     "cost profile's; take a profile of what you want to simulate (tokenweir profile "
                     f"{option_string} ...) and pass it with --profile")


def _refuse_profile_flags(parser: argparse.ArgumentParser) -> None:
    for name in sorted(SIM_SKIPPED_ENGINE_ARGS - {"seed"}):
        parser.add_argument("--" + name.replace("_", "-"), action=_ProfileDecides, help=argparse.SUPPRESS)


def _add_simulate_parser(sub: Any) -> None:
    from tokenweir.bench import serve as bench_serve
    from tokenweir.sim.run import add_sim_args

    sim = sub.add_parser("simulate", help="replay a bench-serve workload through a simulated engine "
                                          "(the real scheduler, step times from a cost profile)")
    add_engine_args(sim, skip=SIM_SKIPPED_ENGINE_ARGS)
    _refuse_profile_flags(sim)
    bench_serve.add_workload_args(sim)
    bench_serve.add_result_args(sim)
    add_sim_args(sim)
    from tokenweir.cluster.config import add_cluster_args

    add_cluster_args(sim, ray=False)
    sim.set_defaults(func=_simulate, simulate_command=None)
    search = sim.add_subparsers(dest="simulate_command").add_parser(
        "search", help="the highest request rate each engine configuration sustains under SLOs")
    add_engine_args(search, sweep=True, skip=SIM_SKIPPED_ENGINE_ARGS)
    _refuse_profile_flags(search)
    bench_serve.add_workload_args(search)
    bench_serve.add_result_args(search, table=False)
    add_sim_args(search, search=True)
    add_cluster_args(search, ray=False)
    search.add_argument("--attainment", type=float, default=0.9,
                        help="fraction of requests that must meet every --goodput SLO")
    search.add_argument("--slo-percentiles", nargs="+", default=None, metavar="METRIC:pNN:MS",
                        help="instead of --goodput: latency percentiles that must stay within "
                             "bounds, e.g. ttft:p90:2000 tpot:p99:100")
    search.add_argument("--start-rate", type=float, default=None,
                        help="first rate tried (default: --rate-scale for the trace, else "
                             "--request-rate, or 1 req/s if that is inf)")
    search.add_argument("--search-iterations", type=int, default=6,
                        help="bisection steps after the doubling phase")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenweir", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="print one completion")
    gen.add_argument("prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=None, help="default 0 (greedy)")
    gen.add_argument("--top-p", type=float, default=None,
                     help="default: the model's generation_config.json (--generation-config auto), else 1")
    gen.add_argument("--seed-sampling", type=int, default=None, help="sampling seed")
    gen.add_argument("--priority", type=int, default=0,
                     help="the request's priority (smaller first; with --low-priority-kv-cache-dtype int8, "
                          "from --low-priority-threshold on its K/V are int8)")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                     help="wrap the prompt in the model's chat template (default on)")
    add_engine_args(gen)
    gen.set_defaults(func=_generate)

    serve = sub.add_parser("serve", help="start the OpenAI-compatible server")
    add_engine_args(serve)
    from tokenweir.server.args import add_server_args

    add_server_args(serve)
    from tokenweir.cluster.config import add_cluster_args

    add_cluster_args(serve)
    serve.set_defaults(func=_serve)

    prof = sub.add_parser("profile", help="measure this device's step times and fit the simulator's cost model")
    from tokenweir.profiling.args import add_cli_args as add_profile_args

    add_profile_args(prof)
    add_engine_args(prof)
    prof.set_defaults(func=_profile)

    _add_simulate_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    from tokenweir.bench import serve as bench_serve

    bench_serve_parser = bench.add_parser("serve", help="load-test an OpenAI-compatible server")
    bench_serve.add_cli_args(bench_serve_parser)
    bench_serve_parser.set_defaults(func=lambda ns: (bench_serve.main(ns), 0)[1])
    return parser


LOGGING_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def configure_logging() -> None:
    """The log format of every tokenweir process (the CLI's, and `serve`'s engine process), and
    the level of tokenweir's loggers from TOKENWEIR_LOGGING_LEVEL (as vLLM's VLLM_LOGGING_LEVEL;
    default INFO). An environment variable, not a flag: the engine process is spawned with the
    server's environment, so both honour it. Other libraries' loggers stay at INFO."""
    level = os.environ.get("TOKENWEIR_LOGGING_LEVEL", "INFO").upper()
    if level not in LOGGING_LEVELS:
        raise ValueError(f"TOKENWEIR_LOGGING_LEVEL must be one of {', '.join(LOGGING_LEVELS)}, "
                         f"got {os.environ['TOKENWEIR_LOGGING_LEVEL']!r}")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    logging.getLogger("tokenweir").setLevel(level)


def main(argv: Optional[Sequence[str]] = None) -> Any:
    parser = build_parser()
    try:
        configure_logging()
    except ValueError as exc:  # a bad TOKENWEIR_LOGGING_LEVEL: one line, as for a bad flag
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = parser.parse_args(argv)
    if getattr(ns, "simulate_command", None) == "search" and argv[argv.index("simulate") + 1] != "search":
        # argparse would silently reset flags given before the subcommand to its defaults.
        parser.error("give `search` right after `simulate`, before any flag")
    try:
        return ns.func(ns)
    except (ValueError, OSError) as exc:  # a bad setting, input or path: say what, no traceback
        parser.exit(2, f"{parser.prog}: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())

"""`tokenweir profile`: time the real engine over a grid of steps, fit the cost model, save it.

The engine is built from the same engine flags as `serve` (model, dtype, device, block size,
KV memory); prefix caching is off so every scheduled token is computed, and the token budget
and sequence cap are set per grid point. By default steps run with the thread choice of
`tokenweir serve` (a small step leaves a core to the serving path), so the profile describes
the engine the simulator stands in for; `--no-serving-threads` profiles the offline engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from datetime import datetime, timezone

import torch

from tokenweir.config import EngineArgs
from tokenweir.profiling.fit import fit_cost_model, fit_errors, format_errors
from tokenweir.profiling.measure import ProfileGrid, StepSample, StepTimer, measure_copy_bandwidth, run_grid


def fitting_grid(grid: ProfileGrid, pool_tokens: int) -> ProfileGrid:
    """The grid without the decode points whose requests would not all fit the KV pool at
    once: the engine cannot run such a batch either, so the simulator never asks for it."""
    def fits(batch: int, context: int) -> bool:
        return batch * grid.decode_context_need(batch, context) <= pool_tokens

    contexts = tuple(c for c in grid.decode_contexts if fits(1, c))
    if not contexts:
        raise ValueError(f"the KV pool ({pool_tokens} tokens) holds no decode point of the grid")
    batches = tuple(b for b in grid.decode_batches if fits(b, max(contexts)))
    return dataclasses.replace(grid, decode_contexts=contexts, decode_batches=batches)


def build_engine(args: EngineArgs, grid: ProfileGrid):
    from tokenweir.engine.core import EngineCore

    args = dataclasses.replace(args, enable_prefix_caching=False, enable_chunked_prefill=True,
                               max_num_batched_tokens=grid.max_tokens(),
                               max_num_seqs=grid.max_seqs(),
                               max_model_len=args.max_model_len or grid.max_len() + 64,
                               disable_log_stats=True)
    return EngineCore(args)


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# Candidate decode knees (0: none); the fit keeps the one that fits best.
DECODE_KNEES = (0, 4, 8, 12, 16, 24, 32)


def fit_profile(samples: list[StepSample], bandwidth: float, metadata: dict,
                small_step_max_tokens: int) -> tuple[dict, str]:
    """Fit the samples; returns the profile's JSON object and the printed error table."""
    comps = [s.composition for s in samples]
    secs = [s.seconds for s in samples]
    model = fit_cost_model(comps, secs, bandwidth, {**metadata, "num_samples": len(samples)},
                           small_step_max_tokens, DECODE_KNEES)
    errors = fit_errors(model, comps, secs, [s.region for s in samples])
    model.metadata["fit_error"] = {e.region: {"samples": e.num_samples, "mape": round(e.mape, 4),
                                              "max_error": round(e.max_error, 4)} for e in errors}
    data = model.to_dict()
    # The raw measurements travel with the fit, so it can be checked or refitted later.
    data["samples"] = [{**dataclasses.asdict(s.composition), "seconds": s.seconds, "region": s.region}
                       for s in samples]
    return data, format_errors(errors)


def profile(args: EngineArgs, grid: ProfileGrid, serving_threads: bool,
            log=lambda s: print(s, file=sys.stderr)) -> tuple[dict, str]:
    """Time the engine over the grid in this process and fit."""
    from tokenweir.engine import serving_threads as threads

    full_threads = torch.get_num_threads()
    small_steps = 0
    if serving_threads and threads.reserve_core_for_serving() is not None:
        small_steps = threads.SMALL_STEP_MAX_TOKENS
    engine = build_engine(args, grid)
    pool_tokens = engine.cache_config.num_blocks * engine.cache_config.block_size
    grid = fitting_grid(grid, pool_tokens)
    timer = StepTimer(engine, engine.kv_bytes_per_block,
                      threads.before_step if serving_threads else (lambda n: None))
    start = time.perf_counter()
    for _ in run_grid(timer, grid, log):
        pass
    metadata = {**engine.describe(), "torch_threads": full_threads, "serving_threads": serving_threads,
                "source": "engine step grid", "grid": args_grid_dict(grid), "measured_at": utc_now(),
                "profile_seconds": round(time.perf_counter() - start, 1)}
    return fit_profile(timer.samples, measure_copy_bandwidth(engine.runner.kv_caches), metadata, small_steps)


def args_grid_dict(grid: ProfileGrid) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(grid).items()}


def main(ns: argparse.Namespace, args: EngineArgs) -> int:
    grid = ProfileGrid.quick() if ns.grid == "quick" else ProfileGrid()
    if ns.serving:
        from tokenweir.profiling.serving import profile_serving

        if ns.serving_threads:
            raise ValueError("--serving-threads applies to the engine grid only: --serving profiles "
                             "`tokenweir serve` as it runs")

        data, table = profile_serving(args, quick=ns.grid == "quick")
    else:
        data, table = profile(args, grid, ns.serving_threads)
    print(table)
    coef = ", ".join(f"{k}={v:.3g}" for k, v in data["coefficients"].items())
    print(f"coefficients (s per unit): {coef}; decode knee {data['decode_knee']}; "
          f"swap {data['swap_bytes_per_second'] / 1e9:.2f} GB/s")
    ns.output.parent.mkdir(parents=True, exist_ok=True)
    ns.output.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {ns.output}", file=sys.stderr)
    return 0

"""PNG plots of a simulated run: latency CDFs and the engine's state over time.

Every figure says in its title that it is simulated and which profile it used, so a plot that
travels without its JSON still says what it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tokenweir.bench.serve_metrics import RequestRecord, get_metric_values

_LATENCY_PANELS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency"))


def _title(data: dict[str, Any]) -> str:
    p = data["profile"]
    load = (f"trace x{data['rate_scale']:g}" if data["dataset_name"] == "trace"
            else f"{data['dataset_name']} at {data['request_rate']} req/s")
    return (f"SIMULATED: {data['num_prompts']} requests, {load}; "
            f"profile {p['model']} {p['dtype']} on {p['device']}")


def write_plots(data: dict[str, Any], records: Sequence[RequestRecord], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    values = get_metric_values(records)
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (name, label) in zip(axes.flat, _LATENCY_PANELS):
        ms = np.sort(np.asarray(values[name]) * 1000.0)
        if len(ms):
            ax.plot(ms, np.arange(1, len(ms) + 1) / len(ms), drawstyle="steps-post")
            for q, style in ((50, ":"), (99, "--")):
                v = float(np.percentile(ms, q))
                ax.axvline(v, color="grey", linestyle=style, linewidth=1)
                ax.annotate(f"p{q} {v:.0f} ms", (v, 0.05 if q == 50 else 0.15), fontsize=8,
                            xytext=(3, 0), textcoords="offset points")
            if ms[-1] > 20 * max(ms[len(ms) // 2], 1e-9):
                ax.set_xscale("log")  # a long tail (a prefill between two tokens) would hide the body
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("fraction of requests" if name != "itl" else "fraction of token gaps")
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3)
        ax.set_title(f"{label} CDF")
    fig.suptitle(_title(data), fontsize=10)
    fig.tight_layout()
    cdf_path = out_dir / "latency_cdf.png"
    fig.savefig(cdf_path, dpi=110)
    plt.close(fig)

    ts = data["timeseries"]
    t = ts["time_s"]
    fig, axes = plt.subplots(4, 1, figsize=(11, 10), sharex=True)
    axes[0].plot(t, ts["num_waiting"], label="waiting")
    axes[0].plot(t, ts["num_running"], label="running")
    if any(ts["num_swapped"]):
        axes[0].plot(t, ts["num_swapped"], label="swapped")
    axes[0].set_ylabel("requests")
    axes[0].legend(loc="upper left")
    axes[1].plot(t, [100 * u for u in ts["kv_cache_usage"]], color="tab:purple")
    axes[1].set_ylabel("KV cache used (%)")
    axes[1].set_ylim(0, 101)
    widths = np.diff([0.0, *t])
    axes[2].bar(t, ts["num_preemptions"], width=-widths, align="edge", color="tab:red")
    axes[2].set_ylabel("preemptions")
    axes[3].plot(t, ts["tokens_per_step"], color="tab:green")
    axes[3].set_ylabel("tokens per step")
    axes[3].set_xlabel("simulated time (s)")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(_title(data), fontsize=10)
    fig.tight_layout()
    ts_path = out_dir / "timeseries.png"
    fig.savefig(ts_path, dpi=110)
    plt.close(fig)
    return [cdf_path, ts_path]

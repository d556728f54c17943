"""How fast does the simulator run? Simulated seconds and steps per wall-clock second.

Cases, all on the shipped CPU profile of the default model:
- saturation with 64 and with 256 running requests (random 256-token prompts and outputs, all
  sent at once, a KV pool large enough that the sequence cap is what binds);
- replay of 10,000 rows of the Azure conversation trace at x1 (far past this CPU's capacity, so
  thousands wait) and at x0.1.

Writes docs/benchmarks/sim_speed.json and prints a markdown table.

    python benchmarks/sim_speed.py
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "benchmarks" / "sim_speed.json"

SATURATION = ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "256",
              "--request-rate", "inf", "--kv-cache-memory", "64GiB", "--max-num-batched-tokens", "2048"]
TRACE = ["--dataset-name", "trace", "--num-prompts", "10000", "--max-input-len", "4096",
         "--max-output-len", "1024"]
CASES = {
    "saturated, 64 running": [*SATURATION, "--num-prompts", "1000", "--max-num-seqs", "64"],
    "saturated, 256 running": [*SATURATION, "--num-prompts", "2000", "--max-num-seqs", "256"],
    "trace x1, 10,000 requests": [*TRACE, "--rate-scale", "1"],
    "trace x0.1, 10,000 requests": [*TRACE, "--rate-scale", "0.1"],
}


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="sim-speed-"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    rows = []
    for name, flags in CASES.items():
        cmd = [sys.executable, "-m", "tokenweir.cli", "simulate", "--disable-tqdm",
               "--result-dir", str(work), "--result-filename", "r.json", *flags]
        start = time.perf_counter()
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        command_seconds = time.perf_counter() - start
        data = json.loads((work / "r.json").read_text())
        ts = data["timeseries"]
        weights = ts["num_steps"]
        mean_running = sum(r * w for r, w in zip(ts["num_running"], weights)) / sum(weights)
        rows.append({
            "case": name, "flags": flags, "completed": data["completed"], "failed": data["failed"],
            "simulated_seconds": data["simulated_seconds"], "wall_seconds": data["wall_seconds"],
            "command_seconds": command_seconds, "num_steps": data["num_steps"],
            "mean_running": mean_running, "max_waiting": max(ts["num_waiting"]),
            "sim_seconds_per_wall_second": data["simulated_seconds_per_wall_second"],
            "steps_per_wall_second": data["steps_per_wall_second"],
        })
        print(f"{name}: {rows[-1]['sim_seconds_per_wall_second']:.0f}x real time, "
              f"{rows[-1]['steps_per_wall_second']:.0f} steps/s", file=sys.stderr)
    OUT.write_text(json.dumps({
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared)",
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": "python benchmarks/sim_speed.py", "profile": "shipped (smollm2-135m-cpu.json)",
        "cases": rows}, indent=2) + "\n")
    print("| case | requests | mean running | max waiting | steps | simulated s | wall s (loop / command) "
          "| x real time | steps/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['completed']} | {r['mean_running']:.0f} | {r['max_waiting']:.0f} | "
              f"{r['num_steps']} | {r['simulated_seconds']:.0f} | {r['wall_seconds']:.1f} / "
              f"{r['command_seconds']:.1f} | {r['sim_seconds_per_wall_second']:.0f} | "
              f"{r['steps_per_wall_second']:.0f} |")


if __name__ == "__main__":
    main()

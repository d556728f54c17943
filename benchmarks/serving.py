"""Serving benchmark: `tokenweir bench serve` trace replay against an OpenAI-compatible server.

Starts the server under test (tokenweir's, or `transformers serve --continuous-batching` on the
same model folder), waits until it answers, sends one warm-up request, replays the first
--num-prompts rows of the Azure conversation trace at each --rate-scale, then stops the server.
Writes docs/benchmarks/serving-<system>.json and prints a markdown table of the runs.

    .venv/bin/python benchmarks/serving.py --system tokenweir
    .venv/bin/python benchmarks/serving.py --system transformers
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tokenweir.bench import serve as bench_serve
from tokenweir.model.gguf_conversion import ensure_hf_folder
from tokenweir.model.loader import default_model_path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks"
BIN = Path(sys.executable).parent
COLUMNS = [("request_throughput", "req/s", 2), ("output_throughput", "out tok/s", 1),
           ("median_ttft_ms", "TTFT p50 ms", 0), ("p90_ttft_ms", "TTFT p90 ms", 0),
           ("p99_ttft_ms", "TTFT p99 ms", 0), ("median_tpot_ms", "TPOT p50 ms", 0),
           ("p90_tpot_ms", "TPOT p90 ms", 0), ("median_itl_ms", "ITL p50 ms", 0),
           ("p99_itl_ms", "ITL p99 ms", 0), ("median_e2el_ms", "E2E p50 ms", 0)]


def server_command(system: str, port: int, hf_folder: str) -> list[str]:
    if system == "tokenweir":
        # No --model: the embedded default model, as a user would start it.
        return [str(BIN / "tokenweir"), "serve", "--port", str(port), "--disable-uvicorn-access-log"]
    return [str(BIN / "transformers"), "serve", hf_folder, "--continuous-batching", "--host", "127.0.0.1",
            "--port", str(port), "--device", "cpu", "--dtype", "bfloat16"]


def stop_server(proc: subprocess.Popen) -> None:
    """Ctrl-C, as a user stops it; killed if it has not exited within 30 s."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_ready(base_url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(f"{base_url}/v1/models", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{base_url} did not answer within {timeout_s} s")


def parse_bench_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_serve.add_cli_args(parser)
    return parser.parse_args(argv)


def warm_up(base_url: str, tokenizer: str, ignore_eos: bool) -> None:
    """A few requests of assorted lengths, not measured: the first batches of a fresh process
    pay for allocator growth and kernel selection per shape."""
    result = bench_serve.main(parse_bench_args([
        "--base-url", base_url, "--dataset-name", "random", "--num-prompts", "8",
        "--random-input-len", "256", "--random-range-ratio", "0.9", "--random-output-len", "16",
        "--tokenizer", tokenizer, "--seed", "999", "--ignore-eos" if ignore_eos else "--no-ignore-eos"]))
    if result["failed"]:
        raise RuntimeError(f"warm-up requests failed: {sorted({e for e in result['errors'] if e})}")


def bench_args(base_url: str, tokenizer: str, ns: argparse.Namespace, rate_scale: float,
               seed: int) -> argparse.Namespace:
    return parse_bench_args([
        "--base-url", base_url, "--dataset-name", "trace", "--num-prompts", str(ns.num_prompts),
        "--rate-scale", str(rate_scale), "--max-input-len", str(ns.max_input_len),
        "--max-output-len", str(ns.max_output_len), "--tokenizer", tokenizer,
        "--metric-percentiles", "50,90,99", "--seed", str(seed),
        "--ignore-eos" if ns.ignore_eos else "--no-ignore-eos"])


def markdown(system: str, runs: list[dict]) -> str:
    head = "| system | rate scale | done/failed | " + " | ".join(c[1] for c in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 3)]
    for run in runs:
        cells = [f"{run[key]:.{digits}f}" for key, _, digits in COLUMNS]
        lines.append(f"| {system} | x{run['rate_scale']:g} | {run['completed']}/{run['failed']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--system", choices=("tokenweir", "transformers"), required=True)
    parser.add_argument("--rate-scales", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0])
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--max-input-len", type=int, default=512)
    parser.add_argument("--max-output-len", type=int, default=64)
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="send ignore_eos (transformers serve rejects the field: use --no-ignore-eos)")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--ready-timeout", type=float, default=600)
    parser.add_argument("--server-arg", action="append", default=[], metavar="FLAG",
                        help="an extra flag for `tokenweir serve` (repeatable), e.g. --server-arg=--engine-in-process")
    parser.add_argument("--label", default="", help="appended to the result file's name")
    ns = parser.parse_args()

    hf_folder = ensure_hf_folder(default_model_path())
    base_url = f"http://127.0.0.1:{ns.port}"
    command = server_command(ns.system, ns.port, hf_folder) + ns.server_arg
    print("server:", " ".join(command), file=sys.stderr)
    log_path = Path(tempfile.gettempdir()) / f"tokenweir-bench-{ns.system}-server.log"
    print("server log:", log_path, file=sys.stderr)
    with open(log_path, "w") as log:
        # Offline: nothing but the local folder may be read (the hub is unreachable here).
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        try:
            started = time.monotonic()
            wait_ready(base_url, proc, ns.ready_timeout)
            ready_s = time.monotonic() - started
            warm_up(base_url, hf_folder, ns.ignore_eos)
            runs = []
            for i, scale in enumerate(ns.rate_scales):
                # A fresh prompt text per run (same trace lengths): a run must not find the
                # previous run's prompts in the prefix cache.
                result = bench_serve.main(bench_args(base_url, hf_folder, ns, scale, seed=i))
                keep = {k: v for k, v in result.items() if not isinstance(v, list)}
                keep["errors"] = sorted({e for e in result["errors"] if e})
                runs.append(keep)
        finally:
            stop_server(proc)
    report = {"system": ns.system, "server_command": command, "server_ready_s": ready_s,
              "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, CPython {platform.python_version()}",
              "args": vars(ns), "runs": runs}
    suffix = ("" if ns.ignore_eos else "-no-ignore-eos") + (f"-{ns.label}" if ns.label else "")
    (OUT / f"serving-{ns.system}{suffix}.json").write_text(json.dumps(report, indent=2))
    print(markdown(ns.system, runs))


if __name__ == "__main__":
    main()

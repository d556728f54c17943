"""`sla` and `vtc` on the real engine: `tokenweir bench serve --slo-mix` against `tokenweir serve`.

(a) Overload: the capacity of `tokenweir serve --scheduling-policy fcfs` at this shape is
measured first (every request sent at once), then the 30% interactive + 70% batch mix is sent
at --load x that rate to a fresh server per policy (fcfs, priority, sla), once per shape of
interactive SLOs (sla_sim.py's SHAPES) on the same server. (b) Two tenants, one sending
--heavy-ratio x the other's requests (request body `tenant`), under fcfs and vtc at the same
rate. (d) "backlogged": sla_sim.py's part of that name, both tenants backlogged (light x0.75 of
the capacity of the last overload run, heavy 10x that) over a --backlogged-window of arrivals,
under fcfs and vtc, measured as a client can (sla_sim.client_view: shares while both tenants
have a request not yet at its first token), beside the simulator's run of the same workload
(its step-level shares and vtc's counter gap, and the same client view). Writes
docs/benchmarks/sla_serving.json (a part not run keeps its previous results) and prints the
per-class tables.

    flock -x /work/notes/cpu.lock .venv/bin/python benchmarks/sla_serving.py [--num-prompts 240] [--parts overload]
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
from pathlib import Path

from serving import parse_bench_args, wait_ready, warm_up  # benchmarks/serving.py
from sla_sim import BACKLOGGED_LIGHT_LOAD, BACKLOGGED_RATIO, SHAPES, client_view, simulate_backlogged

from tokenweir.bench import serve as bench_serve
from tokenweir.bench.serve_metrics import RequestRecord
from tokenweir.bench.slo_mix import format_class_table
from tokenweir.model.gguf_conversion import ensure_hf_folder
from tokenweir.model.loader import default_model_path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "benchmarks"
BIN = Path(sys.executable).parent


def tenant_mix(heavy_ratio: float) -> list[str]:
    return [f"heavy:{heavy_ratio:g}:tenant=heavy", "light:1:tenant=light"]


def workload_args(ns: argparse.Namespace, base_url: str, tokenizer: str, num_prompts: int, rate: float,
                  seed: int, mix: list[str]) -> list[str]:
    args = ["--base-url", base_url, "--dataset-name", "random", "--num-prompts", str(num_prompts),
            "--random-input-len", "256", "--random-output-len", "64", "--random-range-ratio", "0.5",
            "--ignore-eos", "--tokenizer", tokenizer, "--seed", str(seed), "--request-rate", str(rate)]
    return args + (["--slo-mix", *mix] if mix else [])


class Server:
    """`tokenweir serve` (the default model) with one scheduling policy, for a `with` block."""

    def __init__(self, policy: str, ns: argparse.Namespace) -> None:
        self.command = [str(BIN / "tokenweir"), "serve", "--port", str(ns.port), "--disable-uvicorn-access-log",
                        "--max-num-seqs", str(ns.max_num_seqs), "--scheduling-policy", policy]
        self.base_url = f"http://127.0.0.1:{ns.port}"
        self.policy = policy
        self.log_path = Path(tempfile.gettempdir()) / f"tokenweir-sla-serving-{policy}.log"
        self.ready_timeout = ns.ready_timeout

    def __enter__(self) -> Server:
        print("server:", " ".join(self.command), "log:", self.log_path, file=sys.stderr)
        self.log = open(self.log_path, "w")
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        self.proc = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        try:
            wait_ready(self.base_url, self.proc, self.ready_timeout)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def run(server: Server, ns: argparse.Namespace, tokenizer: str, num_prompts: int, rate: float, seed: int,
        mix: list[str]) -> dict:
    result = bench_serve.main(parse_bench_args(workload_args(ns, server.base_url, tokenizer, num_prompts, rate,
                                                             seed, mix)))
    keep = {k: v for k, v in result.items() if not isinstance(v, list)}
    keep["errors"] = sorted({e for e in result["errors"] if e})
    return keep


def scaled_shape(shape: str, scale: float) -> tuple[str, list[str]]:
    """(name, --slo-mix items) of a shape with its interactive class's ttft / tpot SLOs x scale."""
    if scale == 1:
        return shape, SHAPES[shape]
    items = []
    for item in SHAPES[shape]:
        parts = item.split(":")
        if parts[0] == "interactive":
            parts = [p if not p.startswith(("ttft=", "tpot=")) else
                     f"{p[:5]}{float(p[5:]) * scale:g}" for p in parts]
        items.append(":".join(parts))
    return f"{shape}, interactive SLOs x{scale:g}", items


def run_backlogged(server: Server, ns: argparse.Namespace, tokenizer: str, capacity: float) -> dict:
    rate = BACKLOGGED_LIGHT_LOAD * capacity * (BACKLOGGED_RATIO + 1)
    num = round(rate * ns.backlogged_window)
    bench_args = parse_bench_args(workload_args(ns, server.base_url, tokenizer, num, round(rate, 2), ns.seed,
                                                tenant_mix(BACKLOGGED_RATIO)))
    result = bench_serve.main(bench_args)
    # The arrivals and tenants the client used: the same seeded workload, built again.
    workload = bench_serve.build_workload(bench_args, bench_serve.load_tokenizer(bench_args.tokenizer))
    tenants = [c.tenant for c in bench_serve.slo_classes_of(bench_args, num)]
    records = [RequestRecord(success=not error, prompt_len=p, output_tokens=o, ttft=t or 0.0, itl=itl or [])
               for p, o, t, itl, error in zip(result["input_lens"], result["output_lens"], result["ttfts"],
                                               result["itls"], result["errors"])]
    view = client_view([float(t) for t in workload.arrivals], tenants, records)
    # The simulator at the same shape: the same multiples of its own capacity (sla_sim.json's).
    sim_capacity = json.loads((OUT / "sla_sim.json").read_text())["capacity_req_s"]
    simulated = simulate_backlogged(server.policy, ns.seed, sim_capacity, ns.backlogged_window)
    keep = {k: v for k, v in result.items() if not isinstance(v, list)}
    keep["errors"] = sorted({e for e in result["errors"] if e})
    # Streamed chunks against tokens: where a chunk carries several, client_view spreads a
    # request's tokens evenly over its chunks.
    keep["output_chunks"] = sum(len(r.itl) + 1 for r in records if r.success)
    print(f"== backlogged, {server.policy}: client view {view}\nsimulated: {simulated['both_backlogged']}, "
          f"client view {simulated['client_view']}", file=sys.stderr)
    return {"rate_req_s": round(rate, 2), "num_prompts": num, "window_s": ns.backlogged_window,
            "result": keep, "client_view": view,
            "simulated": {k: simulated[k] for k in ("request_rate", "num_prompts", "duration", "num_preemptions",
                                                    "profile", "step_bound_u",
                                                    "both_backlogged", "client_view")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=240)
    parser.add_argument("--capacity-prompts", type=int, default=64)
    parser.add_argument("--load", type=float, default=1.5, help="request rate as a multiple of the capacity")
    parser.add_argument("--heavy-ratio", type=float, default=10.0)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--ready-timeout", type=float, default=600)
    parser.add_argument("--parts", nargs="+", default=["overload", "tenants"],
                        choices=["overload", "tenants", "backlogged"])
    parser.add_argument("--backlogged-window", type=float, default=20.0, help="seconds of arrivals of (d)")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--slo-scale", type=float, default=1.0,
                        help="(a): the interactive class's TTFT and TPOT SLOs x this (a machine faster than "
                             "the one the shapes were set for leaves them slack); recorded as its own shape")
    ns = parser.parse_args()
    if not ns.slo_scale > 0:
        parser.error(f"--slo-scale must be > 0, got {ns.slo_scale}")
    tokenizer = ensure_hf_folder(default_model_path())
    path = OUT / "sla_serving.json"
    previous = json.loads(path.read_text()) if path.exists() else {}
    report: dict = {"machine": f"{platform.machine()}, {platform.processor() or 'cpu'}, CPython "
                               f"{platform.python_version()}, 2 cores shared with other work",
                    # The overload run's flags stay with its results when only later parts run.
                    "args": vars(ns) if "overload" in ns.parts or "args" not in previous else previous["args"],
                    "overload": previous.get("overload", {}), "tenants": previous.get("tenants", {}),
                    "backlogged": previous.get("backlogged", {})}
    # Shapes run now replace their entries; the others stay (a scaled shape runs on its own).
    for policy in ("fcfs", "priority", "sla") if "overload" in ns.parts else ():
        with Server(policy, ns) as server:
            warm_up(server.base_url, tokenizer, ignore_eos=True)
            if "capacity_req_s" not in report:
                capacity = run(server, ns, tokenizer, ns.capacity_prompts, float("inf"), ns.seed + 100, [])
                report["capacity_req_s"] = capacity["request_throughput"]
                report["rate_req_s"] = round(ns.load * capacity["request_throughput"], 3)
                print(f"capacity {report['capacity_req_s']:.2f} req/s -> rate {report['rate_req_s']} req/s",
                      file=sys.stderr)
            for i, shape in enumerate(ns.shapes):  # prompts of another seed per shape: no prefix hits across them
                name, mix = scaled_shape(shape, ns.slo_scale)
                result = run(server, ns, tokenizer, ns.num_prompts, report["rate_req_s"], ns.seed + 10 * i, mix)
                result["capacity_req_s"] = report["capacity_req_s"]
                report["overload"].setdefault(name, {})[policy] = result
                print(f"== overload, {name}, {policy}\n{format_class_table(result['slo_classes'])}", file=sys.stderr)
    if "capacity_req_s" not in report:  # the tenants part alone: the rate of the last overload run
        report["capacity_req_s"], report["rate_req_s"] = previous["capacity_req_s"], previous["rate_req_s"]
    if "tenants" in ns.parts:
        report["tenants"] = {}
    for policy in ("fcfs", "vtc") if "tenants" in ns.parts else ():
        with Server(policy, ns) as server:
            warm_up(server.base_url, tokenizer, ignore_eos=True)
            result = run(server, ns, tokenizer, ns.num_prompts, report["rate_req_s"], ns.seed + 1,
                         tenant_mix(ns.heavy_ratio))
            report["tenants"][policy] = result
            print(f"== tenants, {policy}\n{format_class_table(result['slo_classes'])}", file=sys.stderr)
    if "backlogged" in ns.parts:
        report["backlogged"] = {"args": vars(ns)}
    for policy in ("fcfs", "vtc") if "backlogged" in ns.parts else ():
        with Server(policy, ns) as server:
            warm_up(server.base_url, tokenizer, ignore_eos=True)
            if "capacity_req_s" not in report["backlogged"]:
                # Measured now, on the fcfs server: the shared machine's speed drifts by 2x over
                # hours, and light must ask for more than half of what it is now.
                capacity = run(server, ns, tokenizer, ns.capacity_prompts, float("inf"), ns.seed + 100, [])
                report["backlogged"]["capacity_req_s"] = capacity["request_throughput"]
            report["backlogged"][policy] = run_backlogged(server, ns, tokenizer,
                                                          report["backlogged"]["capacity_req_s"])
    OUT.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()

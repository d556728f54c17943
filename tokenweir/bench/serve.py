"""`tokenweir bench serve`: load an OpenAI-compatible server, report vLLM-comparable metrics.

Flags, metric definitions and result-JSON keys follow `vllm bench serve`, so numbers from
tokenweir and vLLM servers can be compared with the same tool. The trace dataset replays the
Azure LLM inference trace 2023 (conversation), CC-BY 4.0.
"""

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import aiohttp
import numpy as np

from tokenweir.bench.arrivals import make_arrival_times
from tokenweir.bench.client import build_payload, send_request
from tokenweir.bench.datasets import (BenchRequest, PromptBuilder, Tokenizer,
                                      make_prefix_requests, make_random_requests,
                                      make_trace_requests, rate_step_arrivals, read_trace)
from tokenweir.bench.serve_metrics import (METRIC_NAMES, SLO_NAMES, RequestRecord,
                                           compute_metrics, metrics_to_dict)
from tokenweir.bench.serve_report import format_table
from tokenweir.bench.slo_mix import SLOClass, assign_classes, class_report, format_class_table, parse_slo_mix

# The shared trace sits beside the repository checkout; an installed package has no such
# sibling, and then --trace-path is required.
_REPO_TRACE = (Path(__file__).resolve().parents[2] / ".." / "shared" / "data"
               / "azure_llm_2023_conv.csv")
# Long generations under heavy load can take many minutes; only a hung server should time out.
_REQUEST_TIMEOUT_S = 6 * 3600


@dataclass(frozen=True, slots=True)
class Workload:
    requests: list[BenchRequest]
    # Send times in seconds from the benchmark start, one per request.
    arrivals: np.ndarray


def default_trace_path() -> Path | None:
    return _REPO_TRACE.resolve() if _REPO_TRACE.exists() else None


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--endpoint", default="/v1/completions",
                        help="/v1/completions or /v1/chat/completions")
    parser.add_argument("--model", default=None,
                        help="model name to send; default: the first one GET /v1/models lists")
    parser.add_argument("--api-key", default=None,
                        help="bearer token; default: $OPENAI_API_KEY")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=False,
                        help="send ignore_eos (a vLLM extension, not OpenAI's) so every output has the "
                             "requested length")
    add_workload_args(parser)
    add_result_args(parser)


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """What is sent and when: shared by `bench serve` and `simulate`, so both replay the very
    same requests for the same flags."""
    parser.add_argument("--tokenizer", default=None,
                        help="Hugging Face tokenizer folder for exact prompt lengths; without "
                             "it prompts are filler words counted as one token each")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests/s; inf sends all at once")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of inter-arrival gaps; 1 = Poisson, <1 burstier")
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)

    data = parser.add_argument_group("datasets")
    data.add_argument("--dataset-name", choices=("random", "prefix", "trace"), default="random")
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="lengths are uniform in [L*(1-r), L*(1+r)]")
    data.add_argument("--prefix-len", type=int, default=512,
                      help="prefix dataset: tokens of the prompt prefix every request shares")
    data.add_argument("--suffix-len", type=int, default=128,
                      help="prefix dataset: tokens of the unique suffix of each request")
    data.add_argument("--num-prefixes", type=int, default=1,
                      help="prefix dataset: distinct prefixes (system prompts); each request draws one")
    data.add_argument("--trace-path", type=Path, default=default_trace_path(),
                      help="trace CSV (arrived_at,num_prefill_tokens,num_decode_tokens); "
                           "replays its first --num-prompts rows")
    data.add_argument("--rate-scale", type=float, default=1.0,
                      help="trace: multiply the arrival rate (arrival times are divided by it)")
    data.add_argument("--rate-step", default=None, metavar="INDEX:SCALE",
                      help="trace: a load step; rows from INDEX on are replayed at rate scale SCALE "
                           "(those before it at --rate-scale)")
    data.add_argument("--max-input-len", type=int, default=None, help="trace: cap prompt lengths")
    data.add_argument("--max-output-len", type=int, default=None, help="trace: cap output lengths")


def add_result_args(parser: argparse.ArgumentParser, table: bool = True) -> None:
    """How results are scored and saved: shared by `bench serve` and `simulate`. Without
    `table` (`simulate search`, which prints no result table), only the SLOs and the file."""
    parser.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                        help="SLOs a request must all meet to count, e.g. ttft:500 tpot:50; "
                             f"metrics: {', '.join(SLO_NAMES)}")
    parser.add_argument("--slo-mix", nargs="+", default=None, metavar="NAME:FRACTION[:key=value]",
                        help="request classes, e.g. interactive:0.3:priority=0:ttft=1000:tpot=150 "
                             "batch:0.7:priority=1:ttft=60000:tpot=2000 (keys: priority, ttft, tpot, "
                             "deadline in ms, tenant); reports SLO attainment and goodput per class")
    if table:
        parser.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el")
        parser.add_argument("--metric-percentiles", default="50,90,99")
        parser.add_argument("--save-result", action="store_true")
    parser.add_argument("--result-dir", default=".")
    parser.add_argument("--result-filename", default=None,
                        help="JSON file name" + (" (giving one also turns on --save-result)" if table else ""))


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_NAMES:
            raise ValueError(f"bad --goodput item {item!r}; "
                             f"use METRIC:MS with METRIC in {SLO_NAMES}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {name} must be a number of ms, got {value!r}") from None
        if not math.isfinite(slos[name]) or slos[name] < 0:
            raise ValueError(f"--goodput {name} must be a finite number of ms >= 0, got {value!r}")
    return slos


def parse_selected_metrics(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in METRIC_NAMES]
    if bad:
        raise ValueError(f"unknown --percentile-metrics {bad}; choose from {METRIC_NAMES}")
    return names


def parse_percentiles(text: str) -> list[float]:
    values = [float(p) for p in text.split(",") if p.strip()]
    if any(not 0 < p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles must be in (0, 100], got {text}")
    return values


def parse_rate_step(text: str | None) -> tuple[int, float] | None:
    """"150:0.4" -> (150, 0.4): from row 150 on, the trace at rate scale 0.4."""
    if text is None:
        return None
    index, _, scale = text.partition(":")
    try:
        return int(index), float(scale)
    except ValueError:
        raise ValueError(f"bad --rate-step {text!r}; use INDEX:SCALE, e.g. 150:0.4") from None


def build_workload(args: argparse.Namespace, tokenizer: Tokenizer | None) -> Workload:
    rng = np.random.default_rng(args.seed)
    builder = PromptBuilder(rng, tokenizer)
    n = args.num_prompts
    if args.dataset_name == "trace":
        if args.trace_path is None:
            raise ValueError("--dataset-name trace needs --trace-path")
        if not math.isinf(args.request_rate):
            raise ValueError("the trace sets arrival times; scale them with --rate-scale, "
                             "not --request-rate")
        step = parse_rate_step(args.rate_step)
        # With a step the trace's own times are read (scale 1) and each side scaled by its rate.
        rows = read_trace(args.trace_path, n, 1.0 if step else args.rate_scale,
                          args.max_input_len, args.max_output_len)
        arrivals = [r.arrival_s for r in rows]
        if step:
            arrivals = rate_step_arrivals(arrivals, step[0], args.rate_scale, step[1])
        return Workload(make_trace_requests(rows, builder), np.array(arrivals))
    if args.rate_step is not None:
        raise ValueError("--rate-step steps the trace's arrival process; it needs --dataset-name trace")
    if args.dataset_name == "prefix":
        requests = make_prefix_requests(n, args.prefix_len, args.suffix_len,
                                        args.random_output_len, args.random_range_ratio,
                                        builder, rng, args.num_prefixes)
    else:
        requests = make_random_requests(n, args.random_input_len, args.random_output_len,
                                        args.random_range_ratio, builder, rng)
    return Workload(requests, make_arrival_times(n, args.request_rate, args.burstiness, rng))


def slo_classes_of(args: argparse.Namespace, num: int) -> list[SLOClass]:
    """The --slo-mix class of each request ([] without a mix)."""
    classes = parse_slo_mix(args.slo_mix)
    return assign_classes(num, classes, args.seed) if classes else []


async def resolve_model(session: aiohttp.ClientSession, base_url: str,
                        headers: dict[str, str]) -> str:
    url = f"{base_url}/v1/models"
    try:
        async with session.get(url, headers=headers) as response:
            if response.status != 200:
                body = (await response.text())[:300]
                raise ValueError(f"{url} answered HTTP {response.status}: {body} "
                                 "(check --api-key, or pass --model)")
            models = (await response.json())["data"]
    except aiohttp.ClientError as e:
        raise ValueError(f"cannot reach {url}: {e}") from None
    if not models:
        raise ValueError(f"{url} lists no model; pass --model")
    return models[0]["id"]


async def run_requests(session: aiohttp.ClientSession, url: str, headers: dict[str, str],
                       payloads: list[dict], workload: Workload,
                       max_concurrency: int | None) -> tuple[list[RequestRecord], float]:
    """Send each request at its arrival time; returns records in request order and the wall time."""
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter()

    async def one(payload: dict, request: BenchRequest, arrival_s: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, start + arrival_s - time.perf_counter()))
        # A request over the concurrency limit waits here, on the client; its latencies are
        # measured from when it is actually sent, as in vLLM.
        async with semaphore or contextlib.nullcontext():
            return await send_request(session, url, headers, payload, request)

    records = await asyncio.gather(*(one(p, r, float(a)) for p, r, a in
                                     zip(payloads, workload.requests, workload.arrivals)))
    return list(records), time.perf_counter() - start


def request_rate_field(args: argparse.Namespace) -> float | str:
    """The result's `request_rate`: a label, not a float, for inf and the trace (strict JSON
    has no Infinity; vLLM writes "inf")."""
    if args.dataset_name == "trace":
        return "trace"
    if math.isinf(args.request_rate):
        return "inf"
    return args.request_rate


def load_tokenizer(path: str | None) -> Tokenizer | None:
    if path is None:
        return None
    from transformers import AutoTokenizer  # heavy import, only when asked for
    return AutoTokenizer.from_pretrained(path)


def result_path(args: argparse.Namespace, model: str, rate_label: str,
                kind: str = "tokenweir") -> Path:
    name = args.result_filename
    if name is None:
        load = (f"x{args.rate_scale:g}" if args.dataset_name == "trace"
                else f"{rate_label}qps")
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
        name = (f"{kind}-{args.dataset_name}-{load}{concurrency}-"
                f"{model.rstrip('/').split('/')[-1]}-{stamp}.json")
    return Path(args.result_dir) / name


def check_counts(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1 (leave it out for no limit), got {args.max_concurrency}")
    if args.num_prefixes < 1:
        raise ValueError(f"--num-prefixes must be >= 1, got {args.num_prefixes}")
    # Lengths of the synthetic datasets: a request of no tokens is no request (the server would
    # refuse every one), so a length below 1 is refused here rather than made 1.
    for flag in ("random_input_len", "random_output_len", "prefix_len", "suffix_len"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.dataset_name != "trace":
        given = [flag for flag, default in (("rate_scale", 1.0), ("max_input_len", None), ("max_output_len", None))
                 if getattr(args, flag) != default]
        if given:
            raise ValueError(f"--{given[0].replace('_', '-')} applies to --dataset-name trace only, "
                             f"not {args.dataset_name}")


async def _benchmark(args: argparse.Namespace) -> dict:
    check_counts(args)
    slos = parse_goodput(args.goodput)
    selected = parse_selected_metrics(args.percentile_metrics)
    percentiles = parse_percentiles(args.metric_percentiles)
    workload = build_workload(args, load_tokenizer(args.tokenizer))
    base_url = args.base_url.rstrip("/")
    # Read the environment at run time, not when the parser is built.
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    connector = aiohttp.TCPConnector(limit=args.max_concurrency or 0)
    timeout = aiohttp.ClientTimeout(total=_REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model = args.model or await resolve_model(session, base_url, headers)
        payloads = [build_payload(args.endpoint, model, r, args.ignore_eos)
                    for r in workload.requests]
        assigned = slo_classes_of(args, len(payloads))
        for payload, cls in zip(payloads, assigned):
            payload.update(cls.payload_fields())
        print(f"Benchmarking {len(payloads)} {args.dataset_name} requests against "
              f"{base_url}{args.endpoint} (model {model})", file=sys.stderr)
        # Wall-clock time of the first send: places the requests' times (arrival, TTFT, ITLs)
        # on the server's own timeline, e.g. its log lines.
        start_time = time.time()
        records, duration = await run_requests(session, base_url + args.endpoint, headers,
                                               payloads, workload, args.max_concurrency)

    metrics = compute_metrics(records, duration, percentiles, slos)
    rate = request_rate_field(args)
    rate_label = rate if isinstance(rate, str) else f"{rate:g}"
    print(format_table(metrics, selected, args.max_concurrency, rate_label))
    if assigned:
        print(format_class_table(class_report(records, assigned, duration)))
    result = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "base_url": base_url,
        "endpoint": args.endpoint,
        "model_id": model,
        "tokenizer_id": args.tokenizer,
        "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts,
        "request_rate": rate,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "seed": args.seed,
        "ignore_eos": args.ignore_eos,
        "goodput_slos_ms": slos or None,
        "start_time": start_time,
        **metrics_to_dict(metrics, selected),
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [r.output_tokens if r.success else 0 for r in records],
        "ttfts": [r.ttft for r in records],
        "itls": [r.itl for r in records],
        "generated_texts": [r.generated_text for r in records],
        "errors": [r.error for r in records],
    }
    if assigned:
        result["slo_classes"] = class_report(records, assigned, duration)
    if args.dataset_name == "trace":
        result["trace_path"] = str(args.trace_path)
        result["rate_scale"] = args.rate_scale
        if args.rate_step is not None:
            result["rate_step"] = args.rate_step
    if args.save_result or args.result_filename:
        path = result_path(args, model, rate_label)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        print(f"Saved result to {path}", file=sys.stderr)
    return result


def main(args: argparse.Namespace) -> dict:
    """Run the benchmark described by parsed `add_cli_args` flags; returns the result dict."""
    return asyncio.run(_benchmark(args))


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="tokenweir bench serve", description=__doc__)
    add_cli_args(_parser)
    main(_parser.parse_args())

"""`vllm bench serve` command lines, unchanged, for `hetero-pd bench serve`.

vLLM's flag names are aliases of ours where they mean the same (`--base-url` = `--url`,
`--request-rate` = `--rate`, `--goodput` = `--slo`, `--dataset-name` = `--dataset`); the
rest are added here: `--backend`, `--host`/`--port`, `--dataset-path`,
`--sharegpt-output-len`, `--save-result` (+ `--result-dir`, `--result-filename`,
`--save-detailed`, `--append-result`, `--metadata`), `--percentile-metrics`,
`--metric-percentiles`, `--served-model-name`, `--top-p`/`--top-k`/`--min-p`. The result
file carries vLLM's keys (`p99_ttft_ms`, `request_goodput`, ..., and with
`--save-detailed` its per-request lists `input_lens`, `ttfts`, `itls`, ...).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hetero_pd.bench.metrics import LATENCY_METRICS, RequestResult, latency_samples

#: vLLM backends that speak OpenAI's API, and the endpoint each one benchmarks.
BACKENDS = {
    "vllm": "completions",
    "openai": "completions",
    "sglang": "completions",
    "lmdeploy": "completions",
    "llama.cpp": "completions",
    "scalellm": "completions",
    "openai-chat": "chat",
}
ENDPOINT_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


def endpoint_type(text: str) -> str:
    """`--endpoint`: ours (completions | chat) or vLLM's path (/v1/completions, ...)."""
    name = ENDPOINT_PATHS.get(text, text)
    if name not in ("completions", "chat"):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected completions, chat, /v1/completions or /v1/chat/completions"
        )
    return name


def add_vllm_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vllm bench serve's flags (also accepted)")
    g.add_argument("--backend", choices=sorted(BACKENDS), help="openai-chat: the chat endpoint")
    g.add_argument("--host", help="with --port, the server when --url/--base-url is not given")
    g.add_argument("--port", type=int)
    g.add_argument("--dataset-path", help="the file of --dataset-name sharegpt | custom")
    g.add_argument("--sharegpt-output-len", type=int, help="max_tokens for every ShareGPT prompt")
    g.add_argument("--served-model-name", help="model name to send (--model: the tokenizer)")
    g.add_argument("--top-p", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--min-p", type=float)
    g.add_argument("--trust-remote-code", action="store_true", help="accepted, no effect")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl", help="e.g. ttft,tpot,e2el")
    g.add_argument("--metric-percentiles", default="99", help="e.g. 50,90,99.9")
    g.add_argument("--save-result", action="store_true", help="write the result JSON file")
    g.add_argument("--save-detailed", action="store_true", help="with per-request lists")
    g.add_argument("--append-result", action="store_true", help="append a line to the file")
    g.add_argument("--result-dir", type=Path, help="folder of --save-result (default: .)")
    g.add_argument("--result-filename", help="file name of --save-result (default: vLLM's)")
    g.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE")


def normalize(args: argparse.Namespace) -> None:
    """Resolves the aliases in ``args`` (in place) to what the benchmark reads."""
    if args.url is None:
        host = args.host or "127.0.0.1"
        args.url = f"http://{host}:{args.port or 8000}"
    if args.endpoint is None:
        args.endpoint = BACKENDS[args.backend] if args.backend else "completions"
    if args.served_model_name:
        if args.tokenizer is None and args.model and Path(args.model).is_dir():
            args.tokenizer = args.model
        args.model = args.served_model_name
    elif args.tokenizer is None and args.model and Path(args.model).is_dir():
        args.tokenizer = args.model  # vLLM's default: the model's own tokenizer
    if args.dataset == "custom":
        args.dataset = _need_path(args, "custom")
    elif args.dataset == "sharegpt":
        _need_path(args, "sharegpt")
    elif args.dataset_path and args.dataset not in ("random", "mixed"):
        raise ValueError("--dataset-path goes with --dataset-name sharegpt or custom")
    sampling = {"top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p}
    args.extra_body = {**{k: v for k, v in sampling.items() if v is not None}, **args.extra_body}
    for item in args.metadata:
        if "=" not in item:
            raise ValueError(f"--metadata: expected KEY=VALUE, got {item!r}")
    percentile_list(args.metric_percentiles)
    metric_list(args.percentile_metrics)


def _need_path(args: argparse.Namespace, name: str) -> str:
    if not args.dataset_path:
        raise ValueError(f"--dataset-name {name} needs --dataset-path FILE")
    if not Path(args.dataset_path).is_file():
        raise FileNotFoundError(f"--dataset-path: no file {args.dataset_path}")
    return str(args.dataset_path)


def percentile_list(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(
            f"--metric-percentiles: expected numbers like 50,99, got {text!r}"
        ) from None
    if not all(0 < p <= 100 for p in values):
        raise ValueError(f"--metric-percentiles must be in (0, 100], got {text!r}")
    return values


def metric_list(text: str) -> list[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in LATENCY_METRICS]
    if bad:
        raise ValueError(f"--percentile-metrics: unknown {bad}; known: {','.join(LATENCY_METRICS)}")
    return names


def percentile_key(metric: str, p: float) -> str:
    """vLLM's key: p99_ttft_ms, p99.9_ttft_ms."""
    word = str(int(p)) if int(p) == p else str(p)
    return f"p{word}_{metric}_ms"


def result_keys(
    args: argparse.Namespace, results: Sequence[RequestResult], model: str
) -> dict[str, Any]:
    """vLLM's keys our summary does not already have."""
    out: dict[str, Any] = {
        "endpoint_type": args.backend or "openai",
        "model_id": model,
        "tokenizer_id": args.tokenizer or model,
    }
    samples = latency_samples(results)
    for metric in metric_list(args.percentile_metrics):
        ms = np.asarray(samples[metric], dtype=np.float64) * 1000.0
        for p in percentile_list(args.metric_percentiles):
            out[percentile_key(metric, p)] = float(np.percentile(ms, p)) if len(ms) else None
    for item in args.metadata:
        key, _, value = item.partition("=")
        out[key] = value
    if args.save_detailed:
        out.update(
            input_lens=[r.input_tokens for r in results],
            output_lens=[r.output_tokens for r in results],
            ttfts=[r.ttft if r.success else 0.0 for r in results],
            itls=[list(r.itl) for r in results],
            generated_texts=[r.generated_text for r in results],
            errors=[r.error for r in results],
        )
    return out


def result_path(args: argparse.Namespace, model: str) -> Path | None:
    """Where --save-result writes: --result-dir / (--result-filename or vLLM's name)."""
    if not args.save_result:
        return None
    name = args.result_filename
    if not name:
        rate = "inf" if math.isinf(args.rate) else args.rate
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        base = (model or "model").rstrip("/").split("/")[-1]
        now = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        name = f"{args.label or args.backend or 'openai'}-{rate}qps{concurrency}-{base}-{now}.json"
    return (args.result_dir or Path(".")) / name


def save_result(args: argparse.Namespace, result: dict[str, Any]) -> Path | None:
    path = result_path(args, str(result.get("model") or ""))
    if path is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    if args.append_result and path.exists():
        with path.open("a") as f:
            f.write("\n" + json.dumps(result))
    else:
        path.write_text(json.dumps(result))
    return path

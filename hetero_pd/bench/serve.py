"""``hetero-pd bench serve``: load-test any OpenAI-compatible server over streaming requests.

Reports throughput, TTFT / TPOT / ITL / E2E latency (mean, median, p50, p90, p99),
rejections and failures, and with ``--slo`` DistServe's SLO attainment and goodput.
A `vllm bench serve` command line works unchanged (see ``vllm_compat``).
``--sweep`` searches for the highest rate with >= 90% attainment.  Metric definitions
match `vllm bench serve` (see ``metrics``).  Prints a summary table; the last stdout line
is one JSON object.  ``--result-json`` also keeps per-request records; ``--plot-dir``
writes PNGs.

    hetero-pd bench serve --url http://127.0.0.1:8000 --dataset random \\
        --random-input-len 256 --random-output-len 64 --num-prompts 64 --rate 2 \\
        --slo ttft:2000 tpot:200 --result-json out.json --plot-dir plots/
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp

from hetero_pd.bench import datasets as ds
from hetero_pd.bench import vllm_compat as vc
from hetero_pd.bench.client import first_model
from hetero_pd.bench.metrics import SLO, RequestResult, compute_metrics, parse_slo
from hetero_pd.bench.report import format_summary, format_sweep
from hetero_pd.bench.runner import RunConfig, run_benchmark, send_one
from hetero_pd.bench.sweep import GoodputSearch, SweepProbe, run_sweep, sweep_summary
from hetero_pd.deploy.fields import json_object

PROG = "hetero-pd bench serve"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Load-test an OpenAI-compatible server with streaming requests.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("server")
    g.add_argument("--url", "--base-url", help="server base URL (default http://127.0.0.1:8000)")
    g.add_argument("--model", help="model name to send (default: first of GET /v1/models)")
    g.add_argument(
        "--endpoint", type=vc.endpoint_type, help="completions (default) | chat | /v1/..."
    )
    g.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM extension)")
    g.add_argument("--extra-body", type=json_object, default={}, help="JSON merged into bodies")
    g.add_argument("--no-initial-test", action="store_true", help="skip the pre-flight request")

    g = p.add_argument_group("workload")
    g.add_argument(
        "--dataset",
        "--dataset-name",
        default="random",
        help="random | mixed | sharegpt | custom (with --dataset-path) | FILE.jsonl",
    )
    g.add_argument("--tokenizer", help="HF folder or tokenizer.json for exact prompt lengths")
    g.add_argument("--num-prompts", type=int, help="requests per run (default 100; file: all)")
    g.add_argument("--random-input-len", type=int, default=256)
    g.add_argument("--random-output-len", type=int, default=64, help="also the JSONL default")
    g.add_argument("--random-range-ratio", type=float, default=0.0)
    spec = ds.MixedSpec()
    g.add_argument("--mixed-long-fraction", type=float, default=spec.long_fraction)
    g.add_argument("--mixed-short-input-len", type=int, default=spec.short_input_len)
    g.add_argument("--mixed-short-output-len", type=int, default=spec.short_output_len)
    g.add_argument("--mixed-long-input-len", type=int, default=spec.long_input_len)
    g.add_argument("--mixed-long-output-len", type=int, default=spec.long_output_len)
    g.add_argument("--seed", type=int, default=0)

    g = p.add_argument_group("load")
    g.add_argument(
        "--rate",
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests/s (inf: all at once)",
    )
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    g.add_argument("--max-concurrency", type=int, help="most requests in flight")

    g = p.add_argument_group("SLOs and goodput")
    g.add_argument(
        "--slo", "--goodput", nargs="+", default=[], metavar="NAME:MS", help="ttft:MS tpot:MS"
    )
    g.add_argument("--sweep", action="store_true", help="binary-search the goodput rate")
    g.add_argument("--sweep-min-rate", type=float, default=0.25)
    g.add_argument("--sweep-max-rate", type=float, default=16.0)
    g.add_argument("--sweep-max-probes", type=int, default=8)
    g.add_argument("--sweep-target", type=float, default=0.9, help="attainment to reach")

    g = p.add_argument_group("output")
    g.add_argument("--label", default="", help="name of the system under test")
    g.add_argument("--result-json", type=Path, help="write the result (+ per-request records)")
    g.add_argument("--plot-dir", type=Path, help="write latency_cdf.png (+ attainment_vs_rate)")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    vc.add_vllm_arguments(p)
    return p


def load_requests(args: argparse.Namespace) -> list[ds.BenchRequest]:
    """The workload ``args`` describe."""
    source: ds.TextSource = ds.TokenizerText(args.tokenizer) if args.tokenizer else ds.WordText()
    n = args.num_prompts
    if n is not None and n < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {n}")
    if args.dataset == "random":
        return ds.random_requests(
            n or 100,
            args.random_input_len,
            args.random_output_len,
            source,
            args.random_range_ratio,
            args.seed,
        )
    if args.dataset == "sharegpt":
        out_len = args.sharegpt_output_len
        return ds.sharegpt_requests(args.dataset_path, source, n or 1000, out_len, args.seed)
    if args.dataset == "mixed":
        spec = ds.MixedSpec(
            args.mixed_long_fraction,
            args.mixed_short_input_len,
            args.mixed_short_output_len,
            args.mixed_long_input_len,
            args.mixed_long_output_len,
        )
        return ds.mixed_requests(n or 100, spec, source, args.seed)
    if not Path(args.dataset).is_file():
        raise FileNotFoundError(
            f"--dataset: {args.dataset} is not random, mixed or a file "
            "(nor sharegpt or custom with --dataset-path)"
        )
    return ds.jsonl_requests(args.dataset, source, args.random_output_len, n)


def request_records(results: list[RequestResult]) -> list[dict[str, Any]]:
    """Per-request details for the result file."""
    return [
        {
            "prompt_len": r.prompt_len,
            "input_tokens": r.input_tokens,
            "output_tokens": r.output_tokens,
            "success": r.success,
            "status": r.status,
            "error": r.error,
            "ttft_ms": r.ttft * 1000.0 if r.success else None,
            "tpot_ms": t * 1000.0 if (t := r.tpot) is not None else None,
            "e2el_ms": r.latency * 1000.0 if r.success else None,
            "itl_ms": [gap * 1000.0 for gap in r.itl],
        }
        for r in results
    ]


def _config(args: argparse.Namespace, cfg: RunConfig, n: int, slo: SLO) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "label": args.label,
        "url": cfg.url,
        "endpoint": cfg.endpoint,
        "model": cfg.model,
        "dataset": args.dataset,
        "tokenizer": args.tokenizer,
        "num_prompts": n,
        "request_rate": "inf" if math.isinf(cfg.rate) else cfg.rate,
        "burstiness": cfg.burstiness,
        "max_concurrency": cfg.max_concurrency,
        "seed": cfg.seed,
        "ignore_eos": cfg.ignore_eos,
        "slo": slo.to_dict(),
    }


def _run_config(args: argparse.Namespace) -> RunConfig:
    return RunConfig(
        url=args.url,
        model=args.model or "",
        endpoint=args.endpoint,
        rate=args.rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        extra_body=args.extra_body,
        api_key=args.api_key,
        request_timeout=args.request_timeout,
        progress=not args.disable_tqdm,
    )


async def _prepare(args: argparse.Namespace, cfg: RunConfig, first: ds.BenchRequest) -> RunConfig:
    """Name the model (asking the server if needed) and check one request goes through."""
    if not cfg.model:
        async with aiohttp.ClientSession() as session:
            cfg = replace(cfg, model=await first_model(session, cfg.url))
    if not args.no_initial_test:
        probe = await send_one(cfg, replace(first, max_tokens=min(first.max_tokens, 16)))
        if not probe.success:
            raise ConnectionError(f"pre-flight request to {cfg.endpoint_url}: {probe.error}")
    return cfg


async def _single(
    args: argparse.Namespace, cfg: RunConfig, reqs: list[ds.BenchRequest], slo: SLO
) -> tuple[dict[str, Any], list[dict[str, Any]], list[RequestResult]]:
    outcome = await run_benchmark(reqs, cfg)
    metrics = compute_metrics(outcome.results, outcome.duration, slo)
    print(format_summary(metrics, slo, args.label and f"{args.label} results"))
    result = metrics.to_dict()
    result["error_samples"] = sorted({r.error for r in outcome.results if r.error})[:5]
    plots = []
    if args.plot_dir:
        from hetero_pd.bench.plots import plot_latency_cdfs  # matplotlib: the bench extra

        path = args.plot_dir / "latency_cdf.png"
        plots.append(str(plot_latency_cdfs(outcome.results, path, slo, args.label)))
    result["plots"] = plots
    return result, request_records(outcome.results), outcome.results


async def _sweep(
    args: argparse.Namespace,
    cfg: RunConfig,
    reqs: list[ds.BenchRequest],
    slo: SLO,
    search: GoodputSearch,
) -> dict[str, Any]:
    def probe_requests(i: int) -> list[ds.BenchRequest]:
        # Probe i draws with seed + i; a JSONL file's prompts are what they are.
        return (
            reqs
            if i == 0
            else load_requests(argparse.Namespace(**{**vars(args), "seed": args.seed + i}))
        )

    if args.dataset not in ("random", "mixed", "sharegpt"):
        print(
            f"warning: --sweep sends the prompts of {args.dataset} in every probe: a server "
            "with a prefix cache answers repeated prompts from it",
            file=sys.stderr,
        )
    probes = await run_sweep(probe_requests, cfg, slo, search)
    print(format_sweep(probes, search.goodput, search.saturated))
    plots = _sweep_plots(probes, search, slo, args.plot_dir, args.label) if args.plot_dir else []
    # The top-level rate means nothing here: each probe has its own.
    return {"request_rate": None, "sweep": sweep_summary(search, probes), "plots": plots}


async def _bench(args: argparse.Namespace, reqs: list[ds.BenchRequest]) -> dict[str, Any]:
    slo = parse_slo(args.slo)
    search = None
    if args.sweep:
        if slo.empty:
            raise ValueError("--sweep needs an SLO, e.g. --slo ttft:2000 tpot:200")
        search = GoodputSearch(
            args.sweep_min_rate, args.sweep_max_rate, args.sweep_target, args.sweep_max_probes
        )
    cfg = await _prepare(args, _run_config(args), reqs[0])
    result = _config(args, cfg, len(reqs), slo)
    details: list[dict[str, Any]] = []
    if search is None:
        run_result, details, results = await _single(args, cfg, reqs, slo)
        result.update(run_result)
        result.update(vc.result_keys(args, results, cfg.model))
    else:
        result.update(await _sweep(args, cfg, reqs, slo, search))
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        full = {**result, "requests": details} if details else result
        args.result_json.write_text(json.dumps(full, indent=1) + "\n")
        result["result_json"] = str(args.result_json)
    saved = vc.save_result(args, result)
    if saved is not None:
        result["result_file"] = str(saved)
    return result


def _sweep_plots(
    probes: list[SweepProbe], search: GoodputSearch, slo: SLO, out: Path, label: str
) -> list[str]:
    from hetero_pd.bench.plots import plot_attainment_vs_rate, plot_latency_cdfs

    rates = [p.rate for p in probes]
    att = [p.attainment for p in probes]
    paths = [
        plot_attainment_vs_rate(
            rates, att, out / "attainment_vs_rate.png", search.target, search.goodput, label
        )
    ]
    best = next((p for p in probes if p.rate == search.goodput), probes[0])
    title = f"{label} at {best.rate:.3g} req/s".strip()
    paths.append(plot_latency_cdfs(best.results, out / "latency_cdf.png", slo, title))
    return [str(p) for p in paths]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark: 0 when it ran, 1 when the server was unusable, 2 on bad input."""
    args = build_parser().parse_args(argv)
    try:
        vc.normalize(args)
        reqs = load_requests(args)
        result = asyncio.run(_bench(args, reqs))
    except (ValueError, FileNotFoundError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except (TimeoutError, ConnectionError, aiohttp.ClientError) as e:
        print(f"{PROG}: cannot benchmark {args.url}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    if result.get("completed") == 0:
        print(f"{PROG}: no request completed; see error_samples", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

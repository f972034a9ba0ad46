"""`hetero-pd bench pd`: 1P1D disaggregated vs colocated (two `both` workers) vs a single
worker, on one mixed workload (short chat turns plus long summarization prompts, Poisson
arrivals), all in one run on this machine.

Each mode runs the workload twice: its short requests alone, then short and long mixed.
`tpot_p99_ratio_<mode>` = TPOT p99 of the short requests with long prompts interfering,
divided by their TPOT p99 alone. Workers are pinned to cores (sched_setaffinity); the
router and this load generator (one process) are pinned to the first core by default, the
prefill worker's in pd mode, the same in every mode. The last stdout line is one JSON
object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
from dataclasses import replace
from typing import Any

import aiohttp

from hetero_pd.bench import datasets as ds
from hetero_pd.bench.metrics import SLO, compute_metrics, latency_stats
from hetero_pd.bench.runner import RunConfig, run_benchmark
from hetero_pd.deploy.schema import Deployment
from hetero_pd.deploy.sections import RouterSpec, WorkerSpec
from hetero_pd.models.fetch import resolve_model
from hetero_pd.serving.serve import serve


def _modes(cpus: list[int]) -> dict[str, tuple[WorkerSpec, ...]]:
    a, b = (cpus[0], cpus[1]) if len(cpus) > 1 else (cpus[0], cpus[0])
    return {
        "pd": (WorkerSpec("prefill", cpus=(a,)), WorkerSpec("decode", cpus=(b,))),
        "colocated": (WorkerSpec("both", cpus=(a,)), WorkerSpec("both", cpus=(b,))),
        "single": (WorkerSpec("both", cpus=tuple(sorted({a, b}))),),
    }


def _p99_tpot_ms(results: list[Any], short_len: int) -> float | None:
    tpots = [r.tpot for r in results if r.success and r.prompt_len <= short_len * 2]
    stats = latency_stats([t for t in tpots if t is not None])
    return stats.percentiles[99] if stats else None


async def _transfer_seconds(url: str) -> tuple[float, float]:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as resp:
        text = await resp.text()
    total = sum(float(v) for v in re.findall(r"kv_transfer_seconds_sum\{[^}]*\} (\S+)", text))
    count = sum(float(v) for v in re.findall(r"kv_transfer_seconds_count\{[^}]*\} (\S+)", text))
    return total, count


async def _run_mode(
    args: argparse.Namespace,
    dep: Deployment,
    short: list[ds.BenchRequest],
    mixed: list[ds.BenchRequest],
    slo: SLO,
) -> dict[str, Any]:
    result: dict[str, Any] = {}
    stop = asyncio.Event()

    async def on_ready(url: str, launcher: Any, router: Any) -> None:
        cfg = RunConfig(
            url=url,
            model=dep.model,
            rate=args.rate,
            seed=args.seed,
            ignore_eos=True,
            progress=False,
        )
        warm = await run_benchmark(short[:2], replace(cfg, rate=float("inf")))
        assert warm.results
        for name, reqs in (("alone", short), ("mixed", mixed)):
            before = await _transfer_seconds(url)
            outcome = await run_benchmark(reqs, cfg, desc=f"{dep.source} {name}")
            after = await _transfer_seconds(url)
            m = compute_metrics(outcome.results, outcome.duration, slo)
            long_ttft = [
                r.ttft
                for r in outcome.results
                if r.success and r.prompt_len > 2 * args.short_input_len
            ]
            result[name] = {
                "metrics": m.to_dict(),
                "short_tpot_p99_ms": _p99_tpot_ms(outcome.results, args.short_input_len),
                "long_ttft_mean_s": sum(long_ttft) / len(long_ttft) if long_ttft else None,
                "transfer_s": after[0] - before[0],
                "transfers": after[1] - before[1],
            }
        stop.set()

    await serve(dep, on_ready=on_ready, stop=stop)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hetero-pd bench pd", description=__doc__)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--num-short", type=int, default=16)
    p.add_argument("--num-long", type=int, default=4)
    p.add_argument("--short-input-len", type=int, default=64)
    p.add_argument("--short-output-len", type=int, default=64)
    p.add_argument("--long-input-len", type=int, default=1024)
    p.add_argument("--long-output-len", type=int, default=16)
    p.add_argument("--rate", type=float, default=1.0, help="requests/s (Poisson)")
    p.add_argument("--slo-ttft-ms", type=float, default=8000.0)
    p.add_argument("--slo-tpot-ms", type=float, default=200.0)
    p.add_argument("--modes", default="pd,colocated,single")
    p.add_argument("--cpus", default="", help="two core ids to pin workers to (default: 0,1)")
    p.add_argument(
        "--router-cpus",
        default="",
        help="cores for this process (router, API, load generator); default: the first of "
        "--cpus (the prefill worker's in pd mode), so it never runs on the decode core",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-json", help="write every run's full metrics here")
    args = p.parse_args(argv)
    cpus = [int(c) for c in args.cpus.split(",") if c] or sorted(os.sched_getaffinity(0))[:2]
    router_cpus = [int(c) for c in args.router_cpus.split(",") if c] or cpus[:1]
    # Workers set their own affinity after they start; the router and client stay here.
    os.sched_setaffinity(0, router_cpus)
    model_dir = resolve_model(args.model)
    source = ds.TokenizerText(model_dir)
    spec = ds.MixedSpec(
        long_fraction=args.num_long / (args.num_short + args.num_long),
        short_input_len=args.short_input_len,
        short_output_len=args.short_output_len,
        long_input_len=args.long_input_len,
        long_output_len=args.long_output_len,
    )
    mixed = ds.mixed_requests(args.num_short + args.num_long, spec, source, args.seed)
    short = [r for r in mixed if r.prompt_len <= 2 * args.short_input_len]
    slo = SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)
    modes = _modes(cpus)
    out: dict[str, Any] = {
        "pinning": {
            **{name: [list(w.cpus) for w in ws] for name, ws in modes.items()},
            "router_and_client": router_cpus,
        },
        "workload": vars(args),
    }
    for name in args.modes.split(","):
        dep = Deployment(
            model=args.model,
            workers=modes[name],
            router=RouterSpec(port=0),
            engine={"max_num_batched_tokens": 256, "kv_cache_gb": 0.5},
            source=name,
        )
        print(
            f"== {name}: workers pinned to {out['pinning'][name]}, router and load generator "
            f"to {router_cpus}",
            file=sys.stderr,
        )
        res = asyncio.run(_run_mode(args, dep, short, mixed, slo))
        out[name] = res
        alone, mix = res["alone"]["short_tpot_p99_ms"], res["mixed"]["short_tpot_p99_ms"]
        out[f"tpot_p99_ratio_{name}"] = round(mix / alone, 3) if alone and mix else None
        out[f"goodput_{name}"] = res["mixed"]["metrics"]["request_goodput"]
        out[f"ttft_p50_ms_{name}"] = res["mixed"]["metrics"]["p50_ttft_ms"]
        out[f"ttft_p99_ms_{name}"] = res["mixed"]["metrics"]["p99_ttft_ms"]
        out[f"tpot_p50_ms_{name}"] = res["mixed"]["metrics"]["p50_tpot_ms"]
        out[f"tpot_p99_ms_{name}"] = res["mixed"]["metrics"]["p99_tpot_ms"]
        print(
            f"{name:>10}: TPOT p99 short alone {alone} ms, with long prompts {mix} ms; "
            f"goodput {out[f'goodput_{name}']} req/s",
            file=sys.stderr,
        )
    pd = out.get("pd", {}).get("mixed", {})
    if pd.get("transfers") and pd.get("long_ttft_mean_s"):
        mean_transfer = pd["transfer_s"] / pd["transfers"]
        out["transfer_pct_of_ttft"] = round(100 * mean_transfer / pd["long_ttft_mean_s"], 2)
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(out, f, indent=2, default=str)
    summary = {k: v for k, v in out.items() if k not in modes and k != "workload"}
    print(json.dumps(summary, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

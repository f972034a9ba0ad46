"""`hetero-pd bench pd`'s numbers from its runs: interference, goodput over SLO scales and
the PD:colocated ratios, each with its spread over seeds (definitions in `bench.pd`)."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from typing import Any

from hetero_pd.bench import slo_scale as sc
from hetero_pd.bench.metrics import SLO, RequestResult, compute_metrics, latency_stats
from hetero_pd.bench.pd_run import DECISIONS, SeedRun
from hetero_pd.bench.serve import request_records

Runs = dict[str, dict[str, list[SeedRun]]]  # placement -> mode -> one run per seed


def _p99_ms(values: Sequence[float]) -> float | None:
    stats = latency_stats(values)
    return round(stats.percentiles[99], 2) if stats else None


def _short_tpots(results: Sequence[RequestResult], classify: sc.Classify) -> list[float]:
    return [t for r in results if classify(r) == "short" and (t := r.tpot) is not None]


def _requests(runs: Sequence[SeedRun]) -> list[RequestResult]:
    out = [r for run in runs for r in run.isolated]
    for run in runs:
        out += run.alone.results if run.alone else []
        out += [r for phase in run.mixed.values() for r in phase.results]
    return out


def _mode_summary(
    args: argparse.Namespace,
    runs: list[SeedRun],
    ref: dict[str, sc.Isolated],
    classify: sc.Classify,
) -> dict[str, Any]:
    slo = SLO(ttft_ms=args.slo_ttft_ms, tpot_ms=args.slo_tpot_ms)
    interference, goodputs = [], []
    by_scale: dict[float, list[float]] = {k: [] for k in args.slo_scales}
    attain: dict[float, dict[float, list[float]]] = {k: {} for k in args.slo_scales}
    for run in runs:
        assert run.alone is not None
        alone = _p99_ms(_short_tpots(run.alone.results, classify))
        mixed = _p99_ms(_short_tpots(run.mixed[args.rate].results, classify))
        if alone and mixed:
            interference.append(mixed / alone)
        absolute = {
            rate: sum(slo.is_good(r) for r in p.results) / len(p.results)
            for rate, p in run.mixed.items()
        }
        goodputs.append(sc.goodput(absolute))
        for k in args.slo_scales:
            at = {rate: sc.attainment(p.results, ref, k, classify) for rate, p in run.mixed.items()}
            by_scale[k].append(sc.goodput(at))
            for rate, value in at.items():
                attain[k].setdefault(rate, []).append(value)
    at_rate = [r for run in runs for r in run.mixed[args.rate].results]
    m = compute_metrics(at_rate, sum(run.mixed[args.rate].duration for run in runs))
    out: dict[str, Any] = {
        "tpot_p99_ratio": sc.spread(interference) if interference else None,
        "goodput": sc.spread(goodputs),
        "goodput_by_scale": {str(k): sc.spread(v) for k, v in by_scale.items()},
        "attainment_by_scale": {
            str(k): {str(rate): round(statistics.median(v), 3) for rate, v in rates.items()}
            for k, rates in attain.items()
        },
        "failed_requests": sum(not r.success for r in _requests(runs)),
        # where the router computed the mixed phase's prompts at --rate (pd mode)
        "decisions_at_rate": {
            d: sc.spread([run.decisions[args.rate][d] for run in runs]) for d in DECISIONS
        },
    }
    for name in ("ttft", "tpot"):
        stats = m.latencies[name]
        for p in (50, 99):
            out[f"{name}_p{p}_ms"] = round(stats.percentiles[p], 2) if stats else None
    pairs = [
        (t, r.ttft)
        for run in runs
        for r, t in zip(run.isolated, run.transfer_s, strict=True)
        if t is not None and r.success and classify(r) == "long"
    ]
    if pairs:
        out["transfer_over_ttft"] = {**sc.spread([t / ttft for t, ttft in pairs]), "n": len(pairs)}
    return out


def ratios(args: argparse.Namespace, modes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    if "pd" not in modes or "colocated" not in modes:
        return {}
    pd, co = modes["pd"], modes["colocated"]

    def gratio(a: dict[str, float], b: dict[str, float]) -> float | None:
        return sc.ratio(a["median"], b["median"])

    by_scale = {
        k: gratio(pd["goodput_by_scale"][k], co["goodput_by_scale"][k])
        for k in pd["goodput_by_scale"]
    }
    # The tightest scale where the ratio is defined: colocated has a goodput there.
    tightest = next((k for k in map(str, args.slo_scales) if by_scale[k] is not None), None)
    return {
        "goodput_ratio": gratio(pd["goodput"], co["goodput"]),
        "goodput_ratio_by_scale": by_scale,
        "tightest_scale": tightest,
        "goodput_ratio_at_tightest": by_scale[tightest] if tightest else None,
    }


def summarize(
    args: argparse.Namespace, runs: Runs, pinning: dict[str, list[list[int]]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the summary, every request of every run for --result-json)."""
    classify = sc.classifier(2 * args.short_input_len)
    refs = [
        sc.isolated([r for s in seeds for r in s.isolated], classify)
        for by_mode in runs.values()
        for seeds in by_mode.values()
    ]
    ref = sc.fastest(refs)
    results: dict[str, Any] = {}
    for label, by_mode in runs.items():
        modes = {mode: _mode_summary(args, seeds, ref, classify) for mode, seeds in by_mode.items()}
        results[label] = {**modes, **ratios(args, modes)}
    summary = {
        "workload": {
            k: getattr(args, k)
            for k in (
                "model",
                "dtype",
                "num_short",
                "num_long",
                "short_input_len",
                "long_input_len",
                "rate",
                "rates",
                "seeds",
                "slo_scales",
                "slo_ttft_ms",
                "slo_tpot_ms",
                "background_load",
            )
        },
        "pinning": {**pinning, "router_and_client": list(runs)},
        "isolated_reference_ms": {
            cls: {
                "ttft": round(i.ttft * 1e3, 2),
                "tpot": None if i.tpot is None else round(i.tpot * 1e3, 2),
            }
            for cls, i in ref.items()
        },
        "results": results,
    }
    details = {
        label: {
            mode: [
                {
                    "seed": s.seed,
                    "isolated": request_records(s.isolated),
                    "transfer_s": s.transfer_s,
                    "alone": request_records(s.alone.results) if s.alone else [],
                    "mixed": {str(rate): request_records(p.results) for rate, p in s.mixed.items()},
                }
                for s in seeds
            ]
            for mode, seeds in by_mode.items()
        }
        for label, by_mode in runs.items()
    }
    return summary, details

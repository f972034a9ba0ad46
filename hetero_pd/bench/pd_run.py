"""One deployment of `hetero-pd bench pd` through its phases, seed after seed.

Per seed, every phase sends prompts of its own (no phase can hit a prefix cache another
filled), the same prompts in every deployment:

    warm-up   a few short and long requests, all at once (not measured)
    isolated  short and long requests one at a time: what a request costs alone (the SLO
              reference), and per long request its KV transfer / its TTFT
    alone     the short requests of the workload alone, Poisson at --rate
    mixed     short and long mixed, Poisson, once per rate of the sweep
"""

from __future__ import annotations

import asyncio
import re
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp

from hetero_pd.bench import datasets as ds
from hetero_pd.bench.metrics import RequestResult
from hetero_pd.bench.runner import RunConfig, run_benchmark
from hetero_pd.deploy.schema import Deployment
from hetero_pd.deploy.serve import serve


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    num_short: int
    num_long: int
    mixed: ds.MixedSpec
    isolated_short: int
    isolated_long: int
    rate: float
    rates: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class Workload:
    """One seed's prompts, fresh per phase (and per rate of the sweep)."""

    seed: int
    warmup: list[ds.BenchRequest]
    isolated: list[ds.BenchRequest]
    alone: list[ds.BenchRequest]
    mixed: dict[float, list[ds.BenchRequest]]


def _phase_seed(seed: int, phase: str) -> int:
    return zlib.crc32(f"{seed}/{phase}".encode())


def make_workload(spec: WorkloadSpec, source: ds.TextSource, seed: int) -> Workload:
    def only(long: bool, n: int, phase: str) -> list[ds.BenchRequest]:
        mix = replace(spec.mixed, long_fraction=1.0 if long else 0.0)
        return ds.mixed_requests(n, mix, source, _phase_seed(seed, phase))

    def mixed(phase: str) -> list[ds.BenchRequest]:
        n = spec.num_short + spec.num_long
        return ds.mixed_requests(n, spec.mixed, source, _phase_seed(seed, phase))

    return Workload(
        seed=seed,
        warmup=only(False, 2, "warmup-short") + only(True, 1, "warmup-long"),
        isolated=only(False, spec.isolated_short, "isolated-short")
        + only(True, spec.isolated_long, "isolated-long"),
        alone=only(False, spec.num_short, "alone"),
        mixed={rate: mixed(f"mixed@{rate}") for rate in spec.rates},
    )


@dataclass(slots=True)
class Phase:
    results: list[RequestResult]
    duration: float


@dataclass(slots=True)
class SeedRun:
    """What one seed measured on one deployment."""

    seed: int
    isolated: list[RequestResult] = field(default_factory=list)
    #: seconds of KV transfer of each isolated request (None: it made no transfer)
    transfer_s: list[float | None] = field(default_factory=list)
    alone: Phase | None = None
    mixed: dict[float, Phase] = field(default_factory=dict)
    #: per mixed rate, the router's policy decisions in that phase ("local_prefill": a
    #: prompt computed on the decode worker, "disaggregated": on the prefill worker)
    decisions: dict[float, dict[str, int]] = field(default_factory=dict)


DECISIONS = ("local_prefill", "disaggregated")


async def router_metrics(url: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(url + "/metrics") as resp:
        return await resp.text()


def metric_total(text: str, name: str, label: str = "") -> float:
    """The sum of a metric's series over its labels (those whose labels hold `label`)."""
    pattern = rf"{name}\{{([^}}]*)\}} (\S+)"
    return sum(float(v) for labels, v in re.findall(pattern, text) if label in labels)


async def transfer_totals(url: str) -> tuple[float, float]:
    """The router's KV transfer histogram: (seconds, count) summed over transports."""
    text = await router_metrics(url)
    return metric_total(text, "kv_transfer_seconds_sum"), metric_total(
        text, "kv_transfer_seconds_count"
    )


async def decision_totals(url: str) -> dict[str, int]:
    text = await router_metrics(url)
    return {
        d: int(metric_total(text, "hetero_pd_policy_decisions_total", f'decision="{d}"'))
        for d in DECISIONS
    }


async def run_seed(url: str, model: str, spec: WorkloadSpec, w: Workload) -> SeedRun:
    cfg = RunConfig(url=url, model=model, seed=w.seed, ignore_eos=True, progress=False)
    warm = await run_benchmark(w.warmup, cfg)
    failed = [r.error for r in warm.results if not r.success]
    if failed:
        raise RuntimeError(f"warm-up requests failed: {failed[:3]}")
    run = SeedRun(w.seed)
    for req in w.isolated:  # one at a time: no queueing in these numbers
        before = await transfer_totals(url)
        outcome = await run_benchmark([req], cfg)
        after = await transfer_totals(url)
        run.isolated += outcome.results
        run.transfer_s.append(after[0] - before[0] if after[1] - before[1] == 1 else None)
    outcome = await run_benchmark(w.alone, replace(cfg, rate=spec.rate))
    run.alone = Phase(outcome.results, outcome.duration)
    for rate, reqs in sorted(w.mixed.items()):
        decided = await decision_totals(url)
        outcome = await run_benchmark(reqs, replace(cfg, rate=rate))
        run.mixed[rate] = Phase(outcome.results, outcome.duration)
        run.decisions[rate] = {d: n - decided[d] for d, n in (await decision_totals(url)).items()}
    return run


def run_deployment(dep: Deployment, spec: WorkloadSpec, loads: Sequence[Workload]) -> list[SeedRun]:
    """Starts ``dep`` (router and API in this process, workers as processes), runs every
    seed's workload through it and stops it."""
    runs: list[SeedRun] = []
    stop = asyncio.Event()

    async def on_ready(url: str, launcher: Any, router: Any) -> None:
        try:
            for w in loads:
                runs.append(await run_seed(url, dep.model, spec, w))
        finally:
            stop.set()

    asyncio.run(serve(dep, on_ready=on_ready, stop=stop))
    if len(runs) != len(loads):
        raise RuntimeError(f"{dep.source}: {len(runs)} of {len(loads)} seeds finished")
    return runs

"""Goodput (DistServe): the highest request rate at which >= 90% of requests meet the SLOs.

Found by binary search over rates, assuming attainment falls as the rate rises:

    probe min_rate ── fails ──> goodput < min_rate: stop (goodput None)
        │ passes
    probe max_rate ── passes ─> goodput >= max_rate: stop ("saturated"; raise --sweep-max-rate)
        │ fails
    bisect (geometric mean) between the highest passing and lowest failing rate until
    they are within rel_tol of each other or max_probes runs were spent.

Each probe is a full run at one rate, with prompts of its own (the same sizes, the next
seed): repeated prompts would be answered from the server's prefix cache. Attainment
measured on a few hundred requests is noisy, so give the search enough prompts per probe.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hetero_pd.bench.datasets import BenchRequest
from hetero_pd.bench.metrics import SLO, BenchmarkMetrics, RequestResult, compute_metrics
from hetero_pd.bench.runner import RunConfig, run_benchmark


class GoodputSearch:
    """The rate search as a state machine: ask ``next_rate``, run it, ``record`` the result."""

    def __init__(
        self,
        min_rate: float,
        max_rate: float,
        target: float = 0.9,
        max_probes: int = 8,
        rel_tol: float = 0.05,
    ) -> None:
        if not (0 < min_rate < max_rate and math.isfinite(max_rate)):
            raise ValueError(
                f"sweep rates need 0 < min < max < inf, got min={min_rate} max={max_rate}"
            )
        if not 0 < target <= 1:
            raise ValueError(f"--sweep-target must be in (0, 1], got {target}")
        if max_probes < 2:
            raise ValueError(f"--sweep-max-probes must be >= 2, got {max_probes}")
        if rel_tol <= 0:
            raise ValueError(f"relative tolerance must be > 0, got {rel_tol}")
        self.min_rate, self.max_rate = min_rate, max_rate
        self.target, self.max_probes, self.rel_tol = target, max_probes, rel_tol
        self.probes: list[tuple[float, float]] = []
        self.best_pass: float | None = None
        self.worst_fail: float | None = None

    def next_rate(self) -> float | None:
        """The next rate to probe, or None when the search is over."""
        if len(self.probes) >= self.max_probes:
            return None
        if not self.probes:
            return self.min_rate
        lo, hi = self.best_pass, self.worst_fail
        if lo is None or lo >= self.max_rate:
            return None
        if hi is None:
            return self.max_rate
        if hi / lo <= 1 + self.rel_tol:
            return None
        return math.sqrt(lo * hi)

    def record(self, rate: float, attainment: float) -> None:
        """The attainment measured at ``rate``."""
        self.probes.append((rate, attainment))
        if attainment >= self.target:
            self.best_pass = rate if self.best_pass is None else max(self.best_pass, rate)
        else:
            self.worst_fail = rate if self.worst_fail is None else min(self.worst_fail, rate)

    @property
    def goodput(self) -> float | None:
        """The highest rate that met the target; None if even ``min_rate`` missed it."""
        return self.best_pass

    @property
    def saturated(self) -> bool:
        """``max_rate`` itself met the target: the real goodput may be higher."""
        return self.best_pass is not None and self.best_pass >= self.max_rate


@dataclass(frozen=True, slots=True)
class SweepProbe:
    """One run of the sweep."""

    rate: float
    metrics: BenchmarkMetrics
    results: list[RequestResult]

    @property
    def attainment(self) -> float:
        return self.metrics.slo_attainment or 0.0


async def run_sweep(
    requests: Callable[[int], Sequence[BenchRequest]],
    cfg: RunConfig,
    slo: SLO,
    search: GoodputSearch,
) -> list[SweepProbe]:
    """Run probes until ``search`` is done; probe i sends ``requests(i)``. Give each probe
    prompts of its own: a server's prefix cache answers prompts it has seen, so a probe
    that repeats an earlier one's measures the cache rather than the rate."""
    if slo.empty:
        raise ValueError("--sweep needs an SLO, e.g. --slo ttft:2000 tpot:200")
    probes: list[SweepProbe] = []
    while (rate := search.next_rate()) is not None:
        batch = requests(len(probes))
        outcome = await run_benchmark(batch, cfg.with_rate(rate), desc=f"{rate:.3g} req/s")
        metrics = compute_metrics(outcome.results, outcome.duration, slo)
        probe = SweepProbe(rate, metrics, outcome.results)
        search.record(rate, probe.attainment)
        probes.append(probe)
    return probes


def sweep_summary(search: GoodputSearch, probes: Sequence[SweepProbe]) -> dict[str, Any]:
    """The ``sweep`` object of the JSON result."""
    return {
        "target": search.target,
        "min_rate": search.min_rate,
        "max_rate": search.max_rate,
        "max_probes": search.max_probes,
        "goodput_rate": search.goodput,
        "saturated": search.saturated,
        "lowest_failing_rate": search.worst_fail,
        "probes": [{"request_rate": p.rate, **p.metrics.to_dict()} for p in probes],
    }

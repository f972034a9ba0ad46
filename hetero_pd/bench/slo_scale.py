"""Attainment and goodput over SLO scales, as DistServe plots them.

SLOs are set relative to what a request costs alone: at scale ``k`` a request is good when
it completed, its TTFT <= k x the isolated TTFT of its class and its TPOT <= k x the
isolated TPOT of its class (both scaled together; a one-token request meets any TPOT SLO).
Classes are the workload's short and long prompts, whose isolated costs differ by an order
of magnitude. Goodput at a scale is the highest request rate swept whose attainment, and
that of every lower rate swept, is >= the target (90%); 0.0 when the lowest rate misses.

    attainment
      1 |****----__
        |          ``--..__       one curve per deployment and scale;
    0.9 |- - - - - - - - - -`*- - goodput = the last rate above the line
        +------------------------ request rate
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from hetero_pd.bench.metrics import RequestResult

Classify = Callable[[RequestResult], str]
TARGET = 0.9


@dataclass(frozen=True, slots=True)
class Isolated:
    """A class's latencies when its requests run one at a time, in seconds (medians)."""

    ttft: float
    tpot: float | None  # None: the class generates one token only


def classifier(long_above: int) -> Classify:
    """``"long"`` for prompts longer than ``long_above`` tokens, else ``"short"``."""

    def classify(r: RequestResult) -> str:
        return "long" if r.prompt_len > long_above else "short"

    return classify


def isolated(results: Sequence[RequestResult], classify: Classify) -> dict[str, Isolated]:
    """Median TTFT and TPOT per class of requests that each ran alone."""
    out: dict[str, Isolated] = {}
    for cls in sorted({classify(r) for r in results}):
        done = [r for r in results if r.success and classify(r) == cls]
        if not done:
            continue
        tpots = [t for r in done if (t := r.tpot) is not None]
        ttft = statistics.median(r.ttft for r in done)
        out[cls] = Isolated(ttft, statistics.median(tpots) if tpots else None)
    return out


def fastest(refs: Sequence[Mapping[str, Isolated]]) -> dict[str, Isolated]:
    """Per class, the lowest isolated TTFT and TPOT among several deployments: one
    reference for all, so that no deployment is judged against a looser SLO."""
    out: dict[str, Isolated] = {}
    for cls in sorted({c for ref in refs for c in ref}):
        have = [ref[cls] for ref in refs if cls in ref]
        tpots = [i.tpot for i in have if i.tpot is not None]
        out[cls] = Isolated(min(i.ttft for i in have), min(tpots) if tpots else None)
    return out


def is_good(r: RequestResult, ref: Isolated, scale: float) -> bool:
    if not r.success or r.ttft > scale * ref.ttft:
        return False
    tpot = r.tpot
    return tpot is None or ref.tpot is None or tpot <= scale * ref.tpot


def attainment(
    results: Sequence[RequestResult],
    ref: Mapping[str, Isolated],
    scale: float,
    classify: Classify,
) -> float:
    """Good requests / requests sent (failed ones included)."""
    if not results:
        raise ValueError("attainment of an empty run")
    missing = {classify(r) for r in results} - set(ref)
    if missing:
        raise ValueError(f"no isolated reference for request class(es) {sorted(missing)}")
    good = sum(is_good(r, ref[classify(r)], scale) for r in results)
    return good / len(results)


def goodput(by_rate: Mapping[float, float], target: float = TARGET) -> float:
    """The highest rate whose attainment and every lower rate's is >= ``target``."""
    best = 0.0
    for rate in sorted(by_rate):
        if by_rate[rate] < target:
            break
        best = rate
    return best


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b`` rounded, or None when it is undefined: a side missing, or ``b`` 0 (when
    neither deployment met the target at any rate swept, there is nothing to compare)."""
    if a is None or not b:
        return None
    return round(a / b, 3)


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, min and max of per-seed values."""
    return {
        "median": round(statistics.median(values), 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
    }

"""Request arrival times: a Poisson process, or a burstier / steadier gamma process.

Gaps between sends are drawn from ``Gamma(shape=burstiness, scale=1 / (rate * burstiness))``,
as `vllm bench serve` does: the mean gap is always ``1 / rate``, and the coefficient of
variation is ``1 / sqrt(burstiness)``.  ``burstiness == 1`` gives exponential gaps (Poisson
arrivals); below 1 requests come in bursts, above 1 they come more evenly.  An infinite rate
sends everything at once.
"""

from __future__ import annotations

import math

import numpy as np


def check_rate(rate: float, burstiness: float) -> None:
    """Raise ValueError unless ``rate`` and ``burstiness`` describe an arrival process."""
    if math.isnan(rate) or rate <= 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a positive finite number, got {burstiness}")


def arrival_gaps(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """``n`` seconds-long gaps between successive sends (all zero for an infinite rate)."""
    check_rate(rate, burstiness)
    if n < 0:
        raise ValueError(f"number of requests must be >= 0, got {n}")
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    return [float(g) for g in gaps]


def send_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """When each of ``n`` requests is sent, in seconds after the start; the first at 0."""
    gaps = arrival_gaps(max(n - 1, 0), rate, burstiness, seed)
    offsets = [0.0] * n
    for i, gap in enumerate(gaps, start=1):
        offsets[i] = offsets[i - 1] + gap
    return offsets

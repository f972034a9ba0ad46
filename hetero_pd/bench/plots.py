"""PNG plots of a benchmark: latency CDFs of one run, SLO attainment against request rate.

Drawn on matplotlib ``Figure`` objects directly (Agg canvas, no pyplot state), so plotting
is safe in any process and needs no display.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from hetero_pd.bench.metrics import SLO, RequestResult, latency_samples
from hetero_pd.extras import require

require("matplotlib", "bench", "benchmark plots (--plot-dir)")
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

TITLES = {
    "ttft": "Time to first token",
    "tpot": "Time per output token",
    "itl": "Inter-token latency",
    "e2el": "End-to-end latency",
}


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, format="png", dpi=110)
    return path


def plot_latency_cdfs(
    results: Sequence[RequestResult], path: str | Path, slo: SLO | None = None, title: str = ""
) -> Path:
    """One panel per metric (TTFT, TPOT, ITL, E2E): empirical CDF in ms, SLOs as lines."""
    samples = latency_samples(results)
    limits: dict[str, float | None] = dict.fromkeys(TITLES)
    if slo is not None:
        limits.update(ttft=slo.ttft_ms, tpot=slo.tpot_ms, e2el=slo.e2el_ms)
    fig = Figure(figsize=(10, 7), layout="constrained")
    axes = fig.subplots(2, 2).flatten()
    for ax, (name, label) in zip(axes, TITLES.items(), strict=True):
        values = np.sort(np.asarray(samples[name], dtype=np.float64) * 1000.0)
        ax.set_title(f"{label} (n={len(values)})")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if len(values) == 0:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            continue
        ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post")
        if (limit := limits[name]) is not None:
            ax.axvline(limit, color="red", linestyle="--", label=f"SLO {limit:g} ms")
            ax.legend(loc="lower right")
    if title:
        fig.suptitle(title)
    return _save(fig, Path(path))


def plot_attainment_vs_rate(
    rates: Sequence[float],
    attainments: Sequence[float],
    path: str | Path,
    target: float = 0.9,
    goodput: float | None = None,
    title: str = "",
) -> Path:
    """SLO attainment of each probed rate, the target line and the goodput found."""
    order = np.argsort(np.asarray(rates, dtype=np.float64))
    xs = np.asarray(rates, dtype=np.float64)[order]
    ys = np.asarray(attainments, dtype=np.float64)[order] * 100.0
    fig = Figure(figsize=(7, 4.5), layout="constrained")
    ax = fig.subplots()
    ax.plot(xs, ys, marker="o")
    ax.axhline(target * 100.0, color="red", linestyle="--", label=f"target {target:.0%}")
    if goodput is not None:
        ax.axvline(goodput, color="green", linestyle=":", label=f"goodput {goodput:.3g} req/s")
    if len(xs) and xs.min() > 0 and xs.max() / xs.min() > 10:
        ax.set_xscale("log")  # the search bisects geometrically
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 102)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left")
    ax.set_title(title or "SLO attainment vs request rate")
    return _save(fig, Path(path))

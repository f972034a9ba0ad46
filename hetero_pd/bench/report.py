"""The human-readable summary, laid out like `vllm bench serve`'s so they read side by side."""

from __future__ import annotations

from collections.abc import Sequence

from hetero_pd.bench.metrics import PERCENTILES, SLO, BenchmarkMetrics
from hetero_pd.bench.sweep import SweepProbe

WIDTH = 50
SECTIONS = {
    "ttft": "Time to First Token",
    "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency",
    "e2el": "End-to-end Latency",
}


def _row(label: str, value: object) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    elif value is None:
        value = "n/a"
    return f"{label:<40} {value!s:<10}"


def _title(text: str, fill: str) -> str:
    return f" {text} ".center(WIDTH, fill)


def format_summary(m: BenchmarkMetrics, slo: SLO | None = None, title: str = "") -> str:
    """The summary table of one run."""
    lines = [_title(title or "Serving Benchmark Result", "=")]
    lines += [
        _row("Successful requests:", m.completed),
        _row("Failed requests:", m.failed),
        _row("  rejected (HTTP 429):", m.rejected),
        _row("  server errors (HTTP 5xx):", m.server_errors),
        _row("  other errors:", m.other_errors),
        _row("Benchmark duration (s):", m.duration),
        _row("Total input tokens:", m.total_input_tokens),
        _row("Total generated tokens:", m.total_output_tokens),
        _row("Request throughput (req/s):", m.request_throughput),
        _row("Output token throughput (tok/s):", m.output_throughput),
        _row("Total Token throughput (tok/s):", m.total_token_throughput),
    ]
    if slo is not None and not slo.empty:
        targets = ", ".join(f"{k[:-3]} <= {v:g} ms" for k, v in slo.to_dict().items() if v)
        lines += [
            _title("SLO", "-"),
            _row("Targets:", targets),
            _row("Good requests:", m.good_requests),
            _row("SLO attainment (%):", (m.slo_attainment or 0.0) * 100.0),
            _row("Request goodput (req/s):", m.request_goodput),
        ]
    for name, section in SECTIONS.items():
        s = m.latencies[name]
        short = name.upper()
        lines.append(_title(section, "-"))
        lines.append(_row(f"Mean {short} (ms):", s.mean if s else None))
        lines.append(_row(f"Median {short} (ms):", s.median if s else None))
        for p in PERCENTILES:
            if p == 50:  # the median, already shown
                continue
            lines.append(_row(f"P{p} {short} (ms):", s.percentiles[p] if s else None))
    lines.append("=" * WIDTH)
    return "\n".join(lines)


def format_sweep(probes: Sequence[SweepProbe], goodput: float | None, saturated: bool) -> str:
    """One line per probed rate, then the goodput found."""
    lines = [_title("Goodput sweep", "=")]
    lines.append(f"{'rate (req/s)':>12} {'attain %':>9} {'good/s':>8} {'done':>5} {'failed':>6}")
    for p in sorted(probes, key=lambda p: p.rate):
        m = p.metrics
        lines.append(
            f"{p.rate:>12.3f} {p.attainment * 100:>9.1f} {m.request_goodput or 0.0:>8.3f} "
            f"{m.completed:>5} {m.failed:>6}"
        )
    if goodput is None:
        verdict = "none: even the lowest rate missed the target"
    else:
        verdict = f"{goodput:.3f} req/s" + (" (the highest rate tried; may be higher)" * saturated)
    lines.append(_row("Goodput:", verdict))
    lines.append("=" * WIDTH)
    return "\n".join(lines)

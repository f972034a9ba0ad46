"""PNG plots are written and valid; the summary table carries the numbers."""

from __future__ import annotations

from pathlib import Path

from hetero_pd.bench.metrics import SLO, RequestResult, compute_metrics
from hetero_pd.bench.plots import plot_attainment_vs_rate, plot_latency_cdfs
from hetero_pd.bench.report import format_summary

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def results() -> list[RequestResult]:
    out = []
    for i in range(10):
        r = RequestResult(prompt_len=5, max_tokens=4, success=True, status=200)
        r.ttft, r.latency, r.output_tokens = 0.1 + 0.01 * i, 0.4 + 0.02 * i, 4
        r.itl = [0.1, 0.1, 0.1 + 0.005 * i]
        out.append(r)
    out.append(RequestResult(prompt_len=5, max_tokens=4, status=429, error="busy"))
    return out


def test_latency_cdf_png(tmp_path: Path) -> None:
    path = plot_latency_cdfs(results(), tmp_path / "sub" / "cdf.png", SLO(150, 120), "demo")
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert path.stat().st_size > 5_000


def test_plots_tolerate_no_data(tmp_path: Path) -> None:
    failed = [RequestResult(prompt_len=5, max_tokens=4, status=500, error="x")]
    assert plot_latency_cdfs(failed, tmp_path / "c.png").read_bytes()[:8] == PNG_MAGIC


def test_attainment_png(tmp_path: Path) -> None:
    path = plot_attainment_vs_rate([4, 1, 2], [0.5, 1.0, 0.95], tmp_path / "a.png", 0.9, 2.0)
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_summary_table() -> None:
    m = compute_metrics(results(), 2.0, SLO(ttft_ms=155))
    text = format_summary(m, SLO(ttft_ms=155))
    assert "Serving Benchmark Result" in text
    assert "Successful requests:" in text and " 10 " in text
    assert "rejected (HTTP 429):" in text
    assert "SLO attainment (%):" in text and "54.55" in text  # 6 good of 11
    assert "P99 TTFT (ms):" in text and "Mean E2EL (ms):" in text

"""Attainment and goodput over SLO scales: the arithmetic bench pd reports."""

from __future__ import annotations

import pytest

from hetero_pd.bench import slo_scale as sc
from hetero_pd.bench.metrics import RequestResult


def result(prompt_len: int, ttft: float, tpot: float, n: int = 5, ok: bool = True) -> RequestResult:
    latency = ttft + tpot * (n - 1)
    return RequestResult(prompt_len, n, success=ok, ttft=ttft, latency=latency, output_tokens=n)


classify = sc.classifier(100)


def test_isolated_reference_is_per_class_and_the_fastest_deployments() -> None:
    a = sc.isolated(
        [result(10, 0.1, 0.02), result(10, 0.3, 0.04), result(500, 2.0, 0.05)], classify
    )
    assert a["short"].ttft == pytest.approx(0.2) and a["short"].tpot == pytest.approx(0.03)
    assert a["long"].ttft == pytest.approx(2.0)
    b = sc.isolated([result(10, 0.15, 0.05), result(500, 3.0, 0.01)], classify)
    ref = sc.fastest([a, b])
    assert ref["short"].ttft == pytest.approx(0.15) and ref["short"].tpot == pytest.approx(0.03)
    assert ref["long"].ttft == pytest.approx(2.0) and ref["long"].tpot == pytest.approx(0.01)


def test_attainment_scales_both_slos_per_class() -> None:
    ref = {"short": sc.Isolated(0.1, 0.02), "long": sc.Isolated(1.0, 0.02)}
    runs = [
        result(10, 0.14, 0.02),  # TTFT 1.4x
        result(10, 0.1, 0.05),  # TPOT 2.5x
        result(500, 1.9, 0.02),  # TTFT 1.9x, judged against the long reference
        result(10, 0.1, 0.02, ok=False),  # failed: never good
        result(10, 0.1, 0.0, n=1),  # one token: meets any TPOT SLO
    ]
    assert sc.attainment(runs, ref, 1.5, classify) == pytest.approx(2 / 5)
    assert sc.attainment(runs, ref, 2.0, classify) == pytest.approx(3 / 5)
    assert sc.attainment(runs, ref, 3.0, classify) == pytest.approx(4 / 5)
    with pytest.raises(ValueError, match="no isolated reference"):
        sc.attainment(runs, {"short": ref["short"]}, 2.0, classify)


def test_goodput_is_the_last_rate_before_attainment_drops() -> None:
    assert sc.goodput({0.5: 1.0, 1.0: 0.95, 2.0: 0.8, 4.0: 0.92}) == 1.0  # no skipping a dip
    assert sc.goodput({0.5: 0.85, 1.0: 1.0}) == 0.0
    assert sc.goodput({0.5: 0.9, 1.0: 0.9}) == 1.0
    assert sc.ratio(2.0, 1.0) == 2.0 and sc.ratio(0.0, 0.5) == 0.0
    assert sc.ratio(0.0, 0.0) is None  # neither met the target: no parity to claim
    assert sc.ratio(1.0, 0.0) is None and sc.ratio(None, 1.0) is None
    assert sc.spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}

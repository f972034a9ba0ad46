"""Metric math on synthetic timings: percentiles, TPOT, ITL, goodput, attainment."""

from __future__ import annotations

import numpy as np
import pytest

from hetero_pd.bench.metrics import (
    SLO,
    RequestResult,
    compute_metrics,
    latency_stats,
    parse_slo,
)


def ok(ttft: float, latency: float, tokens: int, itl: list[float] | None = None) -> RequestResult:
    return RequestResult(
        prompt_len=10,
        max_tokens=tokens,
        success=True,
        status=200,
        ttft=ttft,
        latency=latency,
        itl=itl or [],
        output_tokens=tokens,
    )


def failed(status: int | None) -> RequestResult:
    return RequestResult(prompt_len=10, max_tokens=4, status=status, error="x")


def test_percentiles_are_numpys_linear_interpolation() -> None:
    values = [0.001 * v for v in (1, 2, 3, 4, 10)]
    s = latency_stats(values)
    assert s is not None
    assert s.mean == pytest.approx(4.0)
    assert s.median == pytest.approx(3.0)
    assert s.std == pytest.approx(float(np.std([1, 2, 3, 4, 10])))
    # linear interpolation: rank (n-1)*p = 3.6 between 4 and 10 -> 4 + 0.6*6
    assert s.percentiles[90] == pytest.approx(7.6)
    assert s.percentiles[99] == pytest.approx(4 + 0.96 * 6)
    assert s.percentiles[50] == pytest.approx(3.0)
    assert latency_stats([]) is None


def test_tpot_ttft_e2e_and_itl_pooling() -> None:
    results = [
        ok(0.1, 0.5, 5, itl=[0.1, 0.1, 0.1, 0.1]),  # tpot = 0.4 / 4 = 0.1
        ok(0.2, 1.0, 3, itl=[0.3, 0.5]),  # tpot = 0.8 / 2 = 0.4
    ]
    m = compute_metrics(results, duration=2.0)
    d = m.to_dict()
    assert d["mean_ttft_ms"] == pytest.approx(150.0)
    assert d["mean_tpot_ms"] == pytest.approx(250.0)
    assert d["mean_e2el_ms"] == pytest.approx(750.0)
    assert d["mean_itl_ms"] == pytest.approx(1200.0 / 6)  # pooled over 6 gaps
    assert d["median_itl_ms"] == pytest.approx(100.0)
    assert d["completed"] == 2 and d["failed"] == 0
    assert d["total_output_tokens"] == 8
    assert d["request_throughput"] == pytest.approx(1.0)
    assert d["output_throughput"] == pytest.approx(4.0)
    assert d["total_token_throughput"] == pytest.approx((20 + 8) / 2.0)
    assert d["slo_attainment"] is None and d["request_goodput"] is None


def test_one_token_request_has_no_tpot_but_meets_tpot_slo() -> None:
    single = ok(0.05, 0.05, 1)
    assert single.tpot is None
    m = compute_metrics([single, ok(0.05, 0.45, 5)], 1.0, parse_slo(["ttft:100", "tpot:50"]))
    assert m.latencies["tpot"] is not None
    assert m.to_dict()["mean_tpot_ms"] == pytest.approx(100.0)  # only the 5-token request
    # the 5-token request misses TPOT (100 ms > 50 ms); the 1-token one is good
    assert m.good_requests == 1


def test_rejected_and_failed_never_good_but_count_in_attainment() -> None:
    results = [
        ok(0.1, 0.3, 3),
        ok(0.1, 0.3, 3),
        ok(0.9, 1.1, 3),  # misses TTFT
        failed(429),
        failed(429),
        failed(503),
        failed(None),  # connection error
        RequestResult(prompt_len=10, max_tokens=3, status=200, ttft=0.0, error="stream"),
    ]
    slo = SLO(ttft_ms=500, tpot_ms=200)
    m = compute_metrics(results, duration=4.0, slo=slo)
    assert (m.completed, m.rejected, m.server_errors, m.other_errors) == (3, 2, 1, 2)
    assert m.failed == 5
    assert m.good_requests == 2
    assert m.slo_attainment == pytest.approx(2 / 8)
    assert m.request_goodput == pytest.approx(2 / 4.0)
    assert m.request_throughput == pytest.approx(3 / 4.0)
    assert not slo.is_good(failed(429))


def test_server_prompt_tokens_preferred_over_dataset_estimate() -> None:
    r = ok(0.1, 0.2, 2)
    r.prompt_tokens = 17
    assert compute_metrics([r], 1.0).total_input_tokens == 17


def test_slo_boundaries_are_inclusive_and_e2el_optional() -> None:
    r = ok(0.5, 1.5, 11)  # tpot = 0.1
    assert SLO(ttft_ms=500, tpot_ms=100).is_good(r)
    assert not SLO(ttft_ms=499).is_good(r)
    assert not SLO(e2el_ms=1000).is_good(r)
    assert SLO(e2el_ms=1500).is_good(r)


def test_parse_slo() -> None:
    assert parse_slo(["ttft:500", "tpot:50"]) == SLO(ttft_ms=500, tpot_ms=50)
    assert parse_slo(["ttft:500,e2el:3000"]) == SLO(ttft_ms=500, e2el_ms=3000)
    assert parse_slo([]).empty
    for bad in (["ttft"], ["foo:1"], ["ttft:abc"], ["tpot:-1"]):
        with pytest.raises(ValueError, match="--slo"):
            parse_slo(bad)


def test_no_completed_requests_gives_null_latencies() -> None:
    m = compute_metrics([failed(429)], 1.0, SLO(ttft_ms=1))
    d = m.to_dict()
    assert d["mean_ttft_ms"] is None and d["p99_itl_ms"] is None
    assert d["slo_attainment"] == 0.0
    with pytest.raises(ValueError, match="duration"):
        compute_metrics([], 0.0)

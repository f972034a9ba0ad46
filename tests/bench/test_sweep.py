"""The goodput binary search, driven by synthetic attainment functions."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hetero_pd.bench.sweep import GoodputSearch


def drive(search: GoodputSearch, attainment: Callable[[float], float]) -> list[float]:
    rates = []
    while (rate := search.next_rate()) is not None:
        assert len(rates) < 50, "the search must be bounded"
        rates.append(rate)
        search.record(rate, attainment(rate))
    return rates


def knee(at: float) -> Callable[[float], float]:
    """Attainment 1 up to ``at`` req/s, then falling fast."""
    return lambda r: 1.0 if r <= at else max(0.0, 1.0 - (r - at))


@pytest.mark.parametrize("true_goodput", [0.3, 1.7, 3.7, 11.0, 31.0])
def test_finds_the_knee_within_tolerance(true_goodput: float) -> None:
    search = GoodputSearch(0.25, 32.0, target=0.9, max_probes=12, rel_tol=0.05)
    rates = drive(search, knee(true_goodput))
    assert len(rates) <= 12
    assert rates[:2] == [0.25, 32.0]
    assert search.goodput is not None
    # attainment >= 0.9 holds up to knee + 0.1
    assert search.goodput <= true_goodput + 0.1
    assert search.goodput >= true_goodput / 1.05 - 1e-9
    assert search.worst_fail is not None and search.worst_fail > search.goodput


def test_probe_budget_is_respected() -> None:
    search = GoodputSearch(0.1, 100.0, max_probes=4, rel_tol=1e-6)
    rates = drive(search, knee(7.0))
    assert len(rates) == 4
    assert search.goodput is not None and search.goodput <= 7.0


def test_saturated_and_hopeless_ends() -> None:
    high = GoodputSearch(1.0, 8.0)
    assert drive(high, lambda r: 1.0) == [1.0, 8.0]
    assert high.goodput == 8.0 and high.saturated
    low = GoodputSearch(1.0, 8.0)
    assert drive(low, lambda r: 0.5) == [1.0]
    assert low.goodput is None and not low.saturated


def test_threshold_is_inclusive() -> None:
    search = GoodputSearch(1.0, 2.0, target=0.9, rel_tol=0.5)
    drive(search, lambda r: 0.9 if r <= 1.0 else 0.0)
    assert search.goodput == 1.0


def test_invalid_bounds() -> None:
    for args in ((0.0, 1.0), (2.0, 1.0), (1.0, float("inf"))):
        with pytest.raises(ValueError, match="sweep rates"):
            GoodputSearch(*args)
    with pytest.raises(ValueError, match="target"):
        GoodputSearch(1.0, 2.0, target=1.5)
    with pytest.raises(ValueError, match="probes"):
        GoodputSearch(1.0, 2.0, max_probes=1)

"""Arrival process statistics: seeded, mean gap 1/rate, CV 1/sqrt(burstiness)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hetero_pd.bench.arrivals import arrival_gaps, send_offsets


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gap_mean_and_variation(burstiness: float) -> None:
    gaps = np.array(arrival_gaps(20_000, rate=8.0, burstiness=burstiness, seed=3))
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.05)
    cv = gaps.std() / gaps.mean()
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.06)
    assert (gaps >= 0).all()


def test_poisson_counts_per_window() -> None:
    # With burstiness 1, counts in unit windows are Poisson(rate): variance == mean.
    offsets = np.array(send_offsets(40_001, rate=5.0, seed=1))
    counts = np.bincount(offsets.astype(int))[:-1]
    assert counts.mean() == pytest.approx(5.0, rel=0.05)
    assert counts.var() == pytest.approx(5.0, rel=0.1)


def test_seeded_and_offsets_start_at_zero() -> None:
    assert arrival_gaps(50, 2.0, 1.0, seed=7) == arrival_gaps(50, 2.0, 1.0, seed=7)
    assert arrival_gaps(50, 2.0, 1.0, seed=7) != arrival_gaps(50, 2.0, 1.0, seed=8)
    offsets = send_offsets(10, 2.0, seed=7)
    assert offsets[0] == 0.0
    assert offsets == sorted(offsets)
    assert offsets[1:] == pytest.approx(np.cumsum(arrival_gaps(9, 2.0, seed=7)).tolist())
    assert send_offsets(0, 1.0) == [] and send_offsets(1, 1.0) == [0.0]


def test_infinite_rate_sends_all_at_once_and_bad_input_is_refused() -> None:
    assert send_offsets(4, math.inf) == [0.0] * 4
    for rate, b in ((0.0, 1.0), (-1.0, 1.0), (math.nan, 1.0), (1.0, 0.0), (1.0, math.inf)):
        with pytest.raises(ValueError):
            arrival_gaps(3, rate, b)

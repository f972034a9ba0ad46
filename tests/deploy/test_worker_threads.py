"""How many threads each worker a launcher starts may run: pinned workers their cores,
workers sharing the host unpinned their share at first and every CPU while the others idle."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from hetero_pd.deploy import launcher
from hetero_pd.deploy.launcher import thread_counts, worker_configs
from hetero_pd.deploy.schema import load_deployment
from hetero_pd.deploy.workers import WorkerInstance


def test_thread_counts() -> None:
    unpinned = WorkerInstance("decode-0", "decode", "cpu")
    pinned = WorkerInstance("decode-1", "decode", "cpu", (2, 3, 5))
    assert thread_counts(unpinned, cpus=4, workers=2) == (4, 2)
    assert thread_counts(unpinned, cpus=3, workers=4) == (3, 1)  # at least one
    assert thread_counts(unpinned, cpus=8, workers=1) == (8, 8)
    assert thread_counts(pinned, cpus=8, workers=2) == (3, None)  # its cores, fixed


def test_unpinned_workers_start_at_their_share_of_the_host(
    write_yaml: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    workers = "[{role: prefill}, {role: decode}, {role: decode, cpus: [3]}]"
    counts = _threads(write_yaml, monkeypatch, 4, f"model: m\nworkers: {workers}\n")
    assert counts == [(4, 1), (4, 1), (1, None)]


def test_a_thread_count_the_deployment_sets_is_what_workers_start_with(
    write_yaml: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    workers = "[{role: prefill}, {role: decode}]"
    text = f"model: m\nworkers: {workers}\nengine: {{num_threads: 16}}\n"
    assert _threads(write_yaml, monkeypatch, 16, text) == [(16, None), (16, None)]


def _threads(
    write_yaml: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, cpus: int, text: str
) -> list[tuple[int | None, int | None]]:
    """(num_threads, initial_threads) of each worker the launcher would start for the
    deployment ``text`` on a host where it may use ``cpus`` CPUs."""
    monkeypatch.setattr(launcher, "usable_cpus", lambda: cpus)
    engines = [c.engine for c in worker_configs(load_deployment(write_yaml(text)))]
    return [(e.num_threads, e.initial_threads) for e in engines]

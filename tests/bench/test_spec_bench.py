"""`hetero-pd bench spec` runs its three workloads end to end at toy sizes, reports every
number and finds the two engines' outputs identical (its numbers: docs/BENCHMARKS.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hetero_pd.bench import spec


def test_bench_spec_compares_plain_and_speculative(
    chat_model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HETERO_PD_ADAPTIVE_THREADS", "1")  # restored after: the bench sets it
    threads = torch.get_num_threads()
    argv = ["--model", str(chat_model), "--num-prompts", "2", "--max-tokens", "12"]
    try:
        assert spec.main([*argv, "--rounds", "1", "--threads", "1", "--kv-cache-gb", "0.05"]) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert set(result["results"]) == {"copy", "random", "random-t1"}
    for r in result["results"].values():
        assert r["identical_outputs"] is True
        assert r["tok_s_ratio"] > 0 and r["spec"]["mean_acceptance_length"] >= 1.0
        assert r["plain"]["tpot_p99_ms"] >= r["plain"]["tpot_p50_ms"] > 0
    assert result["cpu"]["model"]


def test_bench_spec_reports_a_draft_models_step_breakdown_and_its_worst_case(
    chat_model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HETERO_PD_ADAPTIVE_THREADS", "1")
    threads = torch.get_num_threads()
    argv = ["--model", str(chat_model), "--num-prompts", "1", "--max-tokens", "8"]
    argv += ["--method", "draft_model", "--draft-layers", "1", "--worst-case"]
    argv += ["--kv-cache-gb", "0.05"]
    try:
        assert spec.main([*argv, "--rounds", "1", "--threads", "1", "--workloads", "copy"]) == 0
    finally:
        torch.set_num_threads(threads)
    (r,) = json.loads(capsys.readouterr().out.splitlines()[-1])["results"].values()
    assert r["identical_outputs"] is True
    for row in (r["spec"], r["worst"]):
        assert row["drafts"] > 0 and row["propose_ms_per_step"] > 0
        assert row["verify_ms_per_step"] > 0 and row["tok_s_ratio"] > 0
    assert r["worst"]["acceptance_rate"] < 0.5

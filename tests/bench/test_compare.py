"""The side-by-side table the vLLM comparison script prints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetero_pd.bench.compare import main


def test_two_results_side_by_side(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a = {"label": "vllm", "completed": 64, "output_throughput": 38.0, "mean_ttft_ms": None}
    b = {"label": "hetero-pd", "completed": 64, "output_throughput": 57.0, "mean_ttft_ms": 9.5}
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert main([str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[0].split() == ["metric", "vllm", "hetero-pd", "hetero-pd", "/", "vllm"]
    row = next(line for line in out if line.startswith("output tok/s"))
    assert row.split()[-3:] == ["38.0", "57.0", "1.50x"]
    ttft = next(line for line in out if line.startswith("TTFT mean"))
    assert "n/a" in ttft
    last = json.loads(out[-1])
    assert last["hetero-pd"]["output_throughput"] == 57.0


def test_rejects_a_sweep_or_foreign_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "s.json").write_text(json.dumps({"sweep": {}}))
    assert main([str(tmp_path / "s.json")]) == 2
    assert "not a single-run result" in capsys.readouterr().err

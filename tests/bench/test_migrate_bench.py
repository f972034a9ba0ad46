"""`hetero-pd bench migrate` runs end to end on the default model and reports both modes."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetero_pd.bench.migrate import main


def test_bench_migrate_reports_both_modes(
    default_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--model", str(default_model_dir), "--contexts", "40", "--migrations", "1"]
    assert main([*args, "--gap", "2"]) == 0
    out = capsys.readouterr().out
    assert "precopy" in out and "stop-and-copy" in out
    assert "context 40: stop-and-copy pause / pre-copy pause (p50) =" in out

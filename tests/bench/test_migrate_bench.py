"""`hetero-pd bench migrate` runs end to end and reports both modes: on the tiny model, as
the numbers are not the point here, only that both modes migrate and their lines parse
(the bench raises when a migration fails or its request ends first)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetero_pd.bench.migrate import main


def test_bench_migrate_reports_both_modes(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--model", str(tiny_llama_dir), "--contexts", "40", "--migrations", "1"]
    assert main([*args, "--gap", "2"]) == 0
    out = capsys.readouterr().out
    assert "precopy" in out and "stop-and-copy" in out
    assert "context 40: stop-and-copy pause / pre-copy pause (p50) =" in out

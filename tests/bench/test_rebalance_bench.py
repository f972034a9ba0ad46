"""`hetero-pd bench rebalance` runs end to end on the default model and reports both runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetero_pd.bench.rebalance import main


def test_bench_rebalance_reports_both_runs(
    default_model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--model", str(default_model_dir), "--requests", "2", "--prompt-len", "40"]
    assert main([*args, "--max-tokens", "32"]) == 0
    out = capsys.readouterr().out
    assert "rebalance on / off, tpot_p99_ms:" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["on"], ["off"])]
    assert [r[0] for r in rows] == ["off", "on"]
    assert rows[0][-1] == "0"  # rebalancing off moves nothing

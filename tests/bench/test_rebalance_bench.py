"""`hetero-pd bench rebalance` runs end to end and reports both runs: on the tiny model, as
the numbers are not the point here, only that both runs happen and parse (the policy itself
is tests/serving/test_rebalance.py's)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetero_pd.bench.rebalance import main


def test_bench_rebalance_reports_both_runs(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--model", str(tiny_llama_dir), "--requests", "2", "--prompt-len", "40"]
    assert main([*args, "--max-tokens", "32"]) == 0
    out = capsys.readouterr().out
    assert "rebalance on / off, tpot_p99_ms:" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["on"], ["off"])]
    assert [r[0] for r in rows] == ["off", "on"]
    assert rows[0][-1] == "0"  # rebalancing off moves nothing

"""`hetero-pd bench moe` on the smallest shapes: every family's row parses, and our MoE layer
gives transformers' output on the same weights (the bench's comparison is of like with like)."""

from __future__ import annotations

import json

import pytest

from hetero_pd.cli import main as cli


def test_bench_moe_compares_every_family_with_transformers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["bench", "moe", "--tokens", "1", "5", "--hidden", "64", "--experts", "8"]
    argv += ["--inter", "32", "--repeats", "1", "--rounds", "1", "--threads", "1"]
    assert cli(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line[:1] == "{"]
    assert [(r["family"], r["tokens"]) for r in rows] == [
        (family, n) for family in ("mixtral", "qwen3_moe", "deepseek_v3") for n in (1, 5)
    ]
    for r in rows:
        assert r["ours_ms"] > 0 and r["transformers_ms"] > 0 and r["speedup"] > 0
        assert r["max_abs_diff"] < 1e-5, r

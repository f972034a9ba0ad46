"""The per-token and decode-step benches run end to end at toy sizes and report every ratio
(their numbers are in docs/BENCHMARKS.md; here only that they run and say what they measured)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hetero_pd.bench import decode_step, per_token


def test_per_token_compares_both_ways(
    tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert per_token.main(["--tokens", "60", "--rounds", "1"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["tokens"] == 60
    assert set(result["ratios"]) == {"detokenize_old_over_new", "encode_old_over_new"}
    assert all(r > 0 for r in result["ratios"].values())


def test_decode_step_runs_four_engines(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("HETERO_PD_NATIVE_ATTENTION", "HETERO_PD_ADAPTIVE_THREADS"):
        monkeypatch.setenv(name, "1")  # restored after: the bench sets them for its engines
    threads = torch.get_num_threads()
    argv = ["--model", str(tiny_llama_dir), "--batch", "2", "--prompt-len", "8"]
    try:
        assert decode_step.main([*argv, "--steps", "1", "--rounds", "1", "--compile", "off"]) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert set(result["ms_per_step"]) == {name for name, _, _ in decode_step.CONFIGS}
    assert len(result["ratios"]) == 4 and result["cpu"]["model"]

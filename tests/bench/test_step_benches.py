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


def test_decode_step_runs_five_engines(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    names = ("HETERO_PD_NATIVE_ATTENTION", "HETERO_PD_NATIVE_NORM", "HETERO_PD_ADAPTIVE_THREADS")
    for name in names:
        monkeypatch.setenv(name, "1")  # restored after: the bench sets them for its engines
    threads = torch.get_num_threads()
    argv = ["--model", str(tiny_llama_dir), "--batch", "2", "--prompt-len", "8", "--torch-norm"]
    try:
        assert decode_step.main([*argv, "--steps", "1", "--rounds", "1", "--compile", "off"]) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    names = {name for name, _, _ in decode_step.CONFIGS} | {decode_step.TORCH_NORM}
    assert set(result["ms_per_step"]) == names
    assert len(result["ratios"]) == 5 and result["cpu"]["model"]


def test_profile_shares_sum_to_one(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from hetero_pd.bench import profile, profile_ops

    monkeypatch.setenv("HETERO_PD_ADAPTIVE_THREADS", "1")  # restored after: the bench sets it
    threads = torch.get_num_threads()
    argv = ["--model", str(tiny_llama_dir), "--prompts", "2", "--prompt-len", "16"]
    argv += ["--batch", "3", "--context", "12", "--decode-steps", "2", "--repeats", "1"]
    try:
        assert profile.main([*argv, "--threads", "1", "--compile", "off"]) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert set(result["results"]) == {"float32", "bfloat16"} and result["cpu"]["model"]
    for r in result["results"].values():
        for step in ("prefill", "decode"):
            shares = r[step]["shares"]
            assert set(shares) == set(profile_ops.CATEGORIES)
            assert sum(shares.values()) == pytest.approx(1.0, abs=1e-3)
            assert shares["gemm"] > 0 and r[step]["roofline_share"] > 0
        assert r["prefill"]["tokens"] == 32 and r["decode"]["tokens"] == 3


def test_ops_fall_into_their_categories() -> None:
    from hetero_pd.bench.profile_ops import category

    assert category("aten::addmm") == category("mkldnn::_linear_pointwise") == "gemm"
    assert category("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert category("hetero_pd::paged_decode") == "attention"
    assert category("aten::copy_") == category("aten::_to_copy") == "copies"
    assert category("aten::rsqrt") == category("cpp_fused_add_mean_mul_0") == "elementwise"
    assert category("aten::view") == "other_ops"

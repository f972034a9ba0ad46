"""The per-token and decode-step benches run end to end at toy sizes and report every ratio
(their numbers are in docs/BENCHMARKS.md; here only that they run and say what they measured)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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


def run_decode_step(
    model: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *extra: str
) -> dict[str, Any]:
    """`bench decode-step` at toy sizes, eager; its JSON line."""
    names = ("HETERO_PD_NATIVE_ATTENTION", "HETERO_PD_NATIVE_NORM", "HETERO_PD_ADAPTIVE_THREADS")
    for name in names:
        monkeypatch.setenv(name, "1")  # restored after: the bench sets them for its engines
    threads = torch.get_num_threads()
    argv = ["--model", str(model), "--batch", "2", "--prompt-len", "8"]
    try:
        argv += ["--steps", "1", "--rounds", "1", "--compile", "off", *extra]
        assert decode_step.main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    result: dict[str, Any] = json.loads(capsys.readouterr().out.splitlines()[-1])
    return result


def test_decode_step_runs_five_engines(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    result = run_decode_step(tiny_llama_dir, monkeypatch, capsys, "--torch-norm")
    names = {name for name, _, _ in decode_step.CONFIGS} | {decode_step.TORCH_NORM}
    assert set(result["ms_per_step"]) == names
    assert len(result["ratios"]) == 5 and result["cpu"]["model"]


def test_decode_step_of_one_dtype_reports_its_ratios_only(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit, match="--dtypes: float32 and/or bfloat16, got 'float16'"):
        decode_step.main(["--model", str(tiny_llama_dir), "--dtypes", "float16"])
    args = ("--dtypes", "float32", "--torch-norm")
    result = run_decode_step(tiny_llama_dir, monkeypatch, capsys, *args)
    assert set(result["ms_per_step"]) == {"float32+kernel", "float32-kernel"}
    assert set(result["ratios"]) == {"fp32_off_over_on"}


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
    assert category("hetero_pd::prefill_causal") == "attention"  # a named C kernel call
    assert category("aten::copy_") == category("aten::_to_copy") == "copies"
    assert category("aten::rsqrt") == category("cpp_fused_add_mean_mul_0") == "elementwise"
    assert category("aten::view") == "other_ops"


def test_served_flops_are_the_steps_a_served_run_took() -> None:
    """Two requests of 3 prompt tokens and 3 output tokens each: one prefill of 3 tokens and
    decodes at contexts 3 and 4 per request, the LM head on all 6 output tokens; against
    the count by hand for one 2-layer shape set (4 x 8 projections, 4 x 16 head)."""
    from types import SimpleNamespace

    from hetero_pd.bench.profile_ops import served_flops, step_flops

    cfg: Any = SimpleNamespace(num_layers=2, num_heads=2, head_dim=4)  # what the count reads
    shapes = [("q", 8, 4), ("o", 4, 8), ("lm_head", 8, 16)]
    layer, head = 8 * 4 + 4 * 8, 8 * 16
    attn_pairs = (1 + 2 + 3) + 4 + 5  # prefill causal, then decode over 3 + 1 and 4 + 1 keys
    by_hand = 2 * (2 * layer * (3 + 2) + 4 * 2 * 4 * attn_pairs * 2) + 2 * head * 6
    assert served_flops(cfg, shapes, 2, 6, 6) == by_hand
    steps = [step_flops(cfg, shapes, [(3, 0)], 0), *(step_flops(cfg, shapes, [(1, c)], 0)
             for c in (3, 4))]  # fmt: skip
    assert served_flops(cfg, shapes, 2, 6, 6) == 2 * sum(steps) + 6 * 2 * head
    assert served_flops(cfg, shapes, 0, 0, 0) == 0.0

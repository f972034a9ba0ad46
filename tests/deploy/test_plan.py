"""The plan from measured numbers: a real (brief) calibration, and the profile estimate."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from hetero_pd.deploy.calibrate import ModelCosts, calibrate
from hetero_pd.deploy.cli import plan_main
from hetero_pd.deploy.plan import resolve
from hetero_pd.deploy.schema import load_deployment
from hetero_pd.models.config import ModelConfig


def _auto_config(write_yaml: Callable[[str], Path], model: Path) -> Path:
    return write_yaml(
        f"""
        version: 1
        model: {model}
        workload: {{input_len: 64, output_len: 16, rate: 2, ttft_ms: 2000, tpot_ms: 200}}
        pd: {{default_p_rate: 0, default_d_rate: 0, prefill_device: cpu, decode_device: cpu}}
        engine: {{num_threads: 1, max_num_seqs: 16}}
        """
    )


def test_real_calibration_measures_prefill_and_decode(tiny_llama_dir: Path) -> None:
    started = time.perf_counter()
    speed = calibrate(str(tiny_llama_dir), "cpu", prompt_tokens=64, batch=4, steps=3)
    assert time.perf_counter() - started < 30
    assert speed.device == "cpu"
    assert speed.prefill_tokens_per_s > 0
    assert speed.decode_step_ms > 0
    assert speed.decode_ms_per_seq >= 0
    assert speed.source.startswith("calibrated in")


def test_model_costs_of_the_default_model_match_the_design_notes(default_model_dir: Path) -> None:
    costs = ModelCosts.of(ModelConfig.from_dir(default_model_dir), "float32")
    assert costs.flops_per_token / 1e9 == pytest.approx(0.27, abs=0.01)  # DESIGN.md
    assert costs.weight_bytes == 2 * costs.flops_per_token  # 4 bytes per 2 FLOPs


def test_plan_command_calibrates_and_prints_the_reasoning(
    write_yaml: Callable[[str], Path],
    tiny_llama_dir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = _auto_config(write_yaml, tiny_llama_dir)
    assert plan_main([str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan: ")
    assert "prefill on cpu (calibrated in" in out
    assert "s_p = 64 / " in out and "P = ceil(" in out and "D = ceil(" in out


def test_no_calibrate_uses_the_capability_profile(
    write_yaml: Callable[[str], Path], tiny_llama_dir: Path
) -> None:
    dep = load_deployment(_auto_config(write_yaml, tiny_llama_dir))
    assert dep.automatic and not dep.workers
    resolved, plan = resolve(dep, use_calibration=False)
    assert plan is not None
    assert "GFLOP/s" in plan.explain() and "GB/s" in plan.explain()
    assert [(w.role, w.count) for w in resolved.workers] == [
        ("prefill", plan.prefill),
        ("decode", plan.decode),
    ]


def test_measure_prints_a_capacity_block(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert plan_main(["--measure", "cpu", "--model", str(tiny_llama_dir)]) == 0
    out = capsys.readouterr().out
    assert "pd:\n  capacity:\n    cpu:\n      prefill_tokens_per_s: " in out

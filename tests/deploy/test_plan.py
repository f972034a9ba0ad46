"""The plan from measured numbers: a real (brief) calibration, and the profile estimate."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest

from backends import get_backend
from hetero_pd.deploy.calibrate import ModelCosts, calibrate
from hetero_pd.deploy.cli import plan_main
from hetero_pd.deploy.plan import PlanError, plan_deployment, resolve, with_counts
from hetero_pd.deploy.ratio import WorkerSpeed
from hetero_pd.deploy.schema import ConfigError, load_deployment
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


def _speed(device: str, prefill_tokens_per_s: float = 500.0) -> WorkerSpeed:
    return WorkerSpeed(device, prefill_tokens_per_s, 20.0, 1.0, "declared in the test")


def _tp_config(write_yaml: Callable[[str], Path], pd: str, rate: float = 2) -> Path:
    return write_yaml(
        f"""
        model: m
        workload: {{input_len: 64, output_len: 16, rate: {rate}, ttft_ms: 2000, tpot_ms: 200}}
        pd: {{default_p_rate: 0, default_d_rate: 0, {pd}}}
        """
    )


def test_plan_counts_the_devices_of_tensor_parallel_workers(
    write_yaml: Callable[[str], Path],
) -> None:
    """Each prefill worker takes two ranks: the plan says how many devices that makes, the
    workers it fills in carry the size, and CPU ranks are capped at the host's cores."""
    dep = load_deployment(_tp_config(write_yaml, "prefill_tensor_parallel_size: 2"))
    plan = plan_deployment(dep, lambda role, device: _speed(device), cores=8)
    assert plan.ranks == (2, 1)
    total = plan.prefill * 2 + plan.decode
    assert f"{plan.prefill} × 2 + {plan.decode} × 1 = {total} devices" in plan.explain()
    assert "counted no faster than one" in plan.explain()
    workers = with_counts(dep, plan).workers
    assert [(w.role, w.count, w.tensor_parallel_size) for w in workers] == [
        ("prefill", plan.prefill, 2),
        ("decode", plan.decode, 1),
    ]
    # Slow prefill: many workers wanted; 5 cores hold 2 prefill ranks + 3 decode ranks.
    busy = load_deployment(_tp_config(write_yaml, "prefill_tensor_parallel_size: 2", rate=50))
    slow = plan_deployment(busy, lambda role, device: _speed(device, 100.0), cores=5)
    assert slow.prefill * 2 + slow.decode <= 5 and slow.prefill >= 1 and slow.decode >= 1
    assert "(2 and 1 ranks each) on a host with 5 core(s): capped" in slow.explain()


def test_plan_refuses_more_accelerators_than_the_host_has(
    write_yaml: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(type(get_backend("cuda")), "device_count", lambda self: 2)
    dep = load_deployment(
        _tp_config(write_yaml, "prefill_device: cuda, decode_device: cuda", rate=50)
    )
    with pytest.raises(PlanError, match=r"need \d+ cuda devices; this host has 2"):
        plan_deployment(dep, lambda role, device: _speed(device, 100.0), cores=2)
    plan_deployment(dep, lambda role, device: _speed(device, 100.0))  # a cluster: no limit


def test_tensor_parallel_pools_off_the_cpu_are_named(write_yaml: Callable[[str], Path]) -> None:
    path = _tp_config(write_yaml, "decode_device: cuda, decode_tensor_parallel_size: 2")
    with pytest.raises(ConfigError, match=r"pd\.decode_tensor_parallel_size: 2 on a decode"):
        load_deployment(path)


def test_plan_says_what_the_files_tp_workers_take(
    write_yaml: Callable[[str], Path], tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_yaml(
        f"""
        model: {tiny_llama_dir}
        workload: {{input_len: 64, output_len: 16, rate: 2, ttft_ms: 2000, tpot_ms: 200}}
        workers:
          - {{role: prefill, tensor_parallel_size: 2}}
          - {{role: decode}}
        """
    )
    assert plan_main([str(path), "--no-calibrate"]) == 0
    out = capsys.readouterr().out
    assert "the file itself lists 1 prefill + 1 decode workers, taking 3 devices" in out

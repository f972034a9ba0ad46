"""Calibration you can trust: medians with a spread check, agreement with the capability
profile, CPU worker counts capped by the host's cores; `generate` sizes its KV cache; the
start-up port check binds as aiohttp does (SO_REUSEADDR)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hetero_pd.cli import kv_blocks_for
from hetero_pd.deploy.calibrate import (
    CalibrationError,
    calibrate,
    check_agreement,
    noise_notes,
    spread,
)
from hetero_pd.deploy.plan import cap_to_cores, plan_deployment
from hetero_pd.deploy.ratio import Plan, WorkerSpeed
from hetero_pd.deploy.schema import parse_deployment
from hetero_pd.deploy.source import Source
from hetero_pd.deploy.validate import _check_port_free

REPO = Path(__file__).resolve().parents[2]


def speed(
    prefill: float, step_ms: float, per_seq: float = 0.1, notes: tuple[str, ...] = ()
) -> WorkerSpeed:
    return WorkerSpeed("cpu", prefill, step_ms, per_seq, "test numbers", notes)


def test_spread_drops_one_outlier_only_with_four_runs_or_more() -> None:
    assert spread([1.0, 1.1, 1.2]) == pytest.approx(1.2)
    assert spread([1.0, 1.1, 1.2, 9.0]) == pytest.approx(1.2)  # one GC pause is not noise
    assert spread([1.0, 1.1, 5.0, 9.0]) == pytest.approx(5.0)
    assert spread([1.0, 9.0]) == pytest.approx(9.0)


def test_noisy_measures_are_noted_with_their_numbers() -> None:
    notes = noise_notes({"steady": [0.010, 0.011, 0.012], "busy": [0.010, 0.030, 0.031]})
    assert len(notes) == 1
    assert notes[0].startswith("calibration: busy took 10.0..31.0 ms over 3 runs (spread x3.1")


def test_a_real_calibration_reports_medians(tiny_llama_dir: Path) -> None:
    s = calibrate(str(tiny_llama_dir), "cpu", prompt_tokens=32, batch=2, steps=4, num_threads=1)
    assert s.prefill_tokens_per_s > 0 and s.decode_step_ms > 0 and s.decode_ms_per_seq >= 0
    assert "medians of 3 prefills of 32 tokens and 4 decode steps" in s.source
    assert isinstance(s.notes, tuple)


def test_calibration_far_from_the_profile_is_refused() -> None:
    profile = speed(prefill=1000.0, step_ms=100.0)  # 96 tokens: 96 ms of work, comparable
    assert check_agreement(speed(400.0, 250.0), profile) == [
        "prefill: within 2.5x of the profile",
        "decode step: within 2.5x of the profile",
    ]
    with pytest.raises(CalibrationError) as e:
        check_agreement(speed(90.0, 100.0), profile)  # a busy host: 11x slower prefill
    message = str(e.value)
    assert "calibrated prefill 90.0 tokens/s but the capability profile predicts 1000.0" in message
    assert "disagree 11x (more than 5x)" in message and "pd.capacity" in message
    with pytest.raises(CalibrationError, match="decode step"):
        check_agreement(speed(1000.0, 600.0), profile)


def test_models_too_small_for_the_profile_are_not_compared() -> None:
    tiny = speed(prefill=1e7, step_ms=0.01)  # microseconds of work: overheads dominate
    assert check_agreement(speed(500.0, 5.0), tiny) == [
        "prefill: model too small to compare with the profile",
        "decode step: model too small to compare with the profile",
    ]


def _auto(model: Path) -> object:
    return parse_deployment(
        {
            "model": str(model),
            "pd": {"default_p_rate": 0, "default_d_rate": 0},
            "workload": {"input_len": 512, "output_len": 128, "rate": 20, "ttft_ms": 500},
        }
    )


def test_cpu_counts_are_capped_by_the_host_cores(tiny_llama_dir: Path) -> None:
    dep = _auto(tiny_llama_dir)
    slow = speed(prefill=300.0, step_ms=90.0, per_seq=5.0, notes=("calibration: noisy",))
    free = plan_deployment(dep, lambda role, device: slow)  # type: ignore[arg-type]
    assert free.prefill + free.decode > 8, "the workload asks for many workers"
    capped = plan_deployment(dep, lambda role, device: slow, cores=2)  # type: ignore[arg-type]
    assert (capped.prefill, capped.decode) == (1, 1)
    assert any("on a host with 2 core(s): capped to 1P + 1D" in w for w in capped.warnings)
    assert "calibration: noisy" in capped.warnings, "calibration notes reach the plan"


def test_cap_keeps_the_proportion_and_leaves_small_plans_alone() -> None:
    assert cap_to_cores(Plan(1, 2), 4) == Plan(1, 2)
    capped = cap_to_cores(Plan(3, 9), 8)
    assert (capped.prefill, capped.decode) == (2, 6)


def test_generate_sizes_the_kv_cache_for_the_prompt() -> None:
    assert kv_blocks_for([3, 40], 64) == 8  # ceil(104 / 16) + 1
    assert kv_blocks_for([16], 16) == 3


@pytest.mark.dtype  # `generate` and the reference both run `auto`
def test_generate_with_threads_prints_the_reference_completion(
    tiny_llama_dir: Path, auto_dtype: str
) -> None:
    from hetero_pd import LLM, SamplingParams

    argv = ["generate", "--model", str(tiny_llama_dir), "in the", "a b", "--max-tokens", "5"]
    result = subprocess.run(
        [sys.executable, "-m", "hetero_pd.cli", *argv, "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=16)
    expected = [
        o.outputs[0].text
        for o in llm.generate(["in the", "a b"], SamplingParams(temperature=0, max_tokens=5))
    ]
    assert result.stdout == "".join(t + "\n" for t in expected)


def test_the_port_check_ignores_time_wait_but_not_a_listener() -> None:
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        busy = Source("<test>")
        _check_port_free("127.0.0.1", port, busy)
        assert busy.issues and "cannot be bound" in busy.issues[0].message
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = listener.accept()
        conn.close()  # the server side closes first: its end of the connection is in TIME_WAIT
        client.close()
    stopped = Source("<test>")
    _check_port_free("127.0.0.1", port, stopped)
    assert stopped.issues == [], "a stopped server's port is free again at once"

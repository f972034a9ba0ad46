"""`dtype: auto`: the backend's choice from CPU flags and the measured profile."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backends import cpuinfo, get_backend
from backends.dtype import choose_accelerator_dtype, choose_cpu_dtype

HOST = torch.device("cpu")
# The flags of the machines the project runs on (abridged /proc/cpuinfo "flags").
AVX2_ONLY = frozenset(
    [
        "fpu",
        "sse",
        "sse2",
        "ssse3",
        "sse4_1",
        "sse4_2",
        "avx",
        "f16c",
        "fma",
        "avx2",
        "bmi2",
        "vaes",
    ]
)
AVX512_NO_BF16 = AVX2_ONLY | {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
SAPPHIRE_RAPIDS = AVX512_NO_BF16 | {"avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"}
GRAVITON3 = frozenset(["fp", "asimd", "sve", "sve2", "bf16", "i8mm"])


def never_measured() -> tuple[float, float | None]:
    raise AssertionError("a CPU without native bf16 must be decided without probing")


def test_avx2_and_plain_avx512_cpus_get_float32_without_probing() -> None:
    for flags in (AVX2_ONLY, AVX512_NO_BF16, frozenset()):  # checkpoint dtype does not matter
        choice = choose_cpu_dtype(flags, never_measured)
        assert choice.dtype == torch.float32
        assert "no AMX/AVX512-BF16" in choice.reason


@pytest.mark.parametrize("flags", [SAPPHIRE_RAPIDS, GRAVITON3])
def test_native_bf16_cpus_get_bfloat16_when_the_profile_confirms(flags: frozenset[str]) -> None:
    choice = choose_cpu_dtype(flags, lambda: (174.0, 912.0))
    assert choice.dtype == torch.bfloat16
    assert choice.name == "bfloat16"
    assert "912" in choice.reason and "174" in choice.reason


def test_a_bf16_flag_the_profile_contradicts_keeps_float32() -> None:
    slow = choose_cpu_dtype(SAPPHIRE_RAPIDS, lambda: (174.0, 180.0))  # under 1.2x: not worth it
    assert slow.dtype == torch.float32 and "amx_bf16" in slow.reason
    missing = choose_cpu_dtype(SAPPHIRE_RAPIDS, lambda: (174.0, None))
    assert missing.dtype == torch.float32 and "no bf16 kernel" in missing.reason


def test_accelerators_follow_the_checkpoint_like_vllm() -> None:
    bf16, fp32 = torch.bfloat16, torch.float32
    assert choose_accelerator_dtype("GPU H100", True, bf16).dtype == torch.bfloat16
    assert choose_accelerator_dtype("GPU T4", False, bf16).dtype == torch.float16
    # float32 checkpoints (the default model) keep their answers in float16, not bfloat16.
    choice = choose_accelerator_dtype("GPU H100", True, fp32)
    assert choice.dtype == torch.float16 and "float32 checkpoint" in choice.reason
    assert choose_accelerator_dtype("NPU Ascend910B2", True, None).dtype == torch.float16


def test_cpu_flags_come_from_cpuinfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    info = tmp_path / "cpuinfo"
    monkeypatch.setattr(cpuinfo, "CPUINFO_PATH", info)
    info.write_text("processor\t: 0\nmodel name\t: Xeon\nflags\t\t: fpu avx2 amx_bf16\n\n")
    assert cpuinfo.cpu_flags() == {"fpu", "avx2", "amx_bf16"}
    info.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")  # aarch64 spelling
    assert cpuinfo.cpu_flags() == {"fp", "asimd", "bf16"}
    info.unlink()
    assert cpuinfo.cpu_flags() == frozenset()


def test_auto_on_this_host_follows_its_flags() -> None:
    choice = get_backend("cpu").auto_dtype(HOST)
    if not cpuinfo.cpu_flags() & {"amx_bf16", "avx512_bf16", "bf16"}:
        assert choice.dtype == torch.float32  # the AVX2-only development machine
    assert choice.dtype in (torch.float32, torch.bfloat16)
    assert choice.reason.startswith("auto: ")


def test_auto_on_a_faked_amx_host_measures_and_picks_bfloat16(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = get_backend("cpu")
    profile = backend.profile(HOST)  # measured (and cached) before the flags are faked
    info = tmp_path / "cpuinfo"
    info.write_text(f"flags\t\t: {' '.join(sorted(SAPPHIRE_RAPIDS))}\n")
    monkeypatch.setattr(cpuinfo, "CPUINFO_PATH", info)
    half = profile.half_gflops or 0.0
    expected = torch.bfloat16 if half >= 1.2 * profile.fp32_gflops else torch.float32
    assert backend.auto_dtype(HOST).dtype == expected

"""Capability profiles: probe sanity, caching, and the profile record itself."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from backends import CapabilityProfile, clear_profile_cache, get_backend, probe

HOST = torch.device("cpu")
TINY = probe.ProbePlan(matmul_n=64, half_n=32, copy_bytes=1 << 20, reps=2, inner=2)


def _profile(**overrides: object) -> CapabilityProfile:
    fields: dict[str, object] = {
        "kind": "cuda",
        "index": 0,
        "name": "Test GPU",
        "fp32_gflops": 100.0,
        "half_gflops": 400.0,
        "mem_gbps": 50.0,
        "memory_bytes": 8 << 30,
        "threads": 0,
    }
    fields.update(overrides)
    return CapabilityProfile(**fields)  # type: ignore[arg-type]


def test_cpu_profile_is_measured_and_sane() -> None:
    clear_profile_cache()  # measured here, under this thread count (profiles are cached)
    backend = get_backend("cpu")
    profile = backend.profile(HOST)
    assert (profile.kind, profile.index) == ("cpu", 0)
    assert profile.name == backend.device_name(HOST)
    assert profile.fp32_gflops > 0
    assert profile.half_gflops is not None and profile.half_gflops > 0
    assert profile.mem_gbps > 0
    assert profile.memory_bytes == backend.memory_info(HOST)[1]
    assert profile.threads == torch.get_num_threads()


def test_profile_is_cached_per_device_and_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cached profile is returned without measuring: the matmul probe is counted, not timed."""
    backend = get_backend("cpu")
    first = backend.profile(HOST)
    measured: list[torch.dtype] = []
    matmul_gflops = probe.matmul_gflops

    def counted(dev: torch.device, dtype: torch.dtype, *args: object) -> float:
        measured.append(dtype)
        return matmul_gflops(dev, dtype, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(probe, "matmul_gflops", counted)
    assert backend.profile(torch.device("cpu", 0)) is first
    assert measured == []
    clear_profile_cache()
    assert backend.profile(HOST) is not first
    assert measured[0] == torch.float32  # measured again once forgotten


def test_profile_rejects_foreign_devices() -> None:
    with pytest.raises(ValueError, match="given a cuda device"):
        get_backend("cpu").profile(torch.device("cuda", 0))


def test_probes_report_positive_rates() -> None:
    calls: list[int] = []

    def sync() -> None:
        calls.append(1)

    assert probe.matmul_gflops(HOST, torch.float32, 64, TINY, sync) > 0
    assert len(calls) == TINY.reps + 1  # one warm-up, then the timed reps
    assert probe.copy_gbps(HOST, TINY.copy_bytes, TINY, sync) > 0


def test_half_probe_can_be_skipped() -> None:
    skip = dataclasses.replace(TINY, half_n=0)
    assert probe.half_gflops(HOST, torch.bfloat16, skip, lambda: None) is None
    # No kernel for the dtype: a capability answer, not a crash.
    assert probe.half_gflops(HOST, torch.int8, TINY, lambda: None) is None
    assert probe.half_gflops(HOST, torch.bfloat16, TINY, lambda: None) is not None


def test_best_seconds_keeps_the_fastest_rep() -> None:
    now = [0.0]
    durations = iter([5.0, 3.0, 1.0, 2.0])  # warm-up first (not timed), then three reps

    def run() -> None:
        now[0] += next(durations)

    assert probe.best_seconds(run, lambda: None, reps=3, clock=lambda: now[0]) == 1.0


def test_scores_and_dict() -> None:
    profile = _profile()
    assert profile.prefill_score() == 400.0
    assert profile.decode_score() == 50.0
    assert _profile(half_gflops=None).prefill_score() == 100.0
    assert _profile(half_gflops=20.0).prefill_score() == 100.0  # slow bf16 on a cpu
    as_dict = profile.to_dict()
    assert as_dict["name"] == "Test GPU"
    assert json.loads(json.dumps(as_dict)) == as_dict


def test_profile_is_frozen() -> None:
    profile = _profile()
    with pytest.raises(dataclasses.FrozenInstanceError):
        profile.fp32_gflops = 1.0  # type: ignore[misc]
    assert not hasattr(profile, "__dict__")

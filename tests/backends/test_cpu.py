"""The cpu backend: copies, host buffers, memory reporting, (absent) streams and events."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from backends import cpu, cpuinfo, get_backend
from backends.cpu import NATIVE_BF16, CpuBackend
from backends.cpuinfo import cpu_flags

HOST = torch.device("cpu")


@pytest.fixture
def backend() -> CpuBackend:
    found = get_backend("cpu")
    assert isinstance(found, CpuBackend)
    return found


def test_single_always_available_device(backend: CpuBackend) -> None:
    assert backend.is_available()
    assert backend.device_count() == 1
    assert backend.device() == HOST
    assert backend.device(0) == HOST
    with pytest.raises(ValueError, match="cpu:1 does not exist"):
        backend.device(1)
    assert backend.device_name(HOST)
    assert not backend.supports_ipc()


def test_no_streams_or_events_and_sync_is_a_no_op(backend: CpuBackend) -> None:
    assert backend.new_stream(HOST) is None
    assert backend.new_event(HOST, enable_timing=True) is None
    backend.synchronize()
    backend.synchronize(HOST)


def test_rejects_devices_of_other_kinds(backend: CpuBackend) -> None:
    with pytest.raises(ValueError, match="the cpu backend was given a cuda device"):
        backend.new_stream(torch.device("cuda", 0))
    with pytest.raises(ValueError, match="single device 'cpu'"):
        backend.memory_info(torch.device("cpu", 1))


def test_memory_info_is_plausible(backend: CpuBackend) -> None:
    free, total = backend.memory_info(HOST)
    assert 0 < free <= total


def test_memory_info_reads_meminfo(
    backend: CpuBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  2048 kB\nMemFree:  512 kB\nMemAvailable:  1024 kB\n")
    monkeypatch.setattr(cpu, "MEMINFO_PATH", meminfo)
    monkeypatch.setattr(cpu, "CGROUP_LIMIT_PATHS", ())
    assert backend.memory_info(HOST) == (1024 * 1024, 2048 * 1024)


def test_memory_info_is_clamped_to_the_cgroup_limit(
    backend: CpuBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  4194304 kB\nMemAvailable:  3145728 kB\n")  # 4 GiB, 3 GiB
    limit, usage = tmp_path / "memory.max", tmp_path / "memory.current"
    limit.write_text(f"{1 << 30}\n")
    usage.write_text(f"{256 << 20}\n")
    monkeypatch.setattr(cpu, "MEMINFO_PATH", meminfo)
    monkeypatch.setattr(cpu, "CGROUP_LIMIT_PATHS", ((limit, usage),))
    assert backend.memory_info(HOST) == (768 << 20, 1 << 30)
    limit.write_text("max\n")  # cgroup v2 without a limit
    assert backend.memory_info(HOST) == (3 << 30, 4 << 30)


def test_memory_info_falls_back_to_sysconf(
    backend: CpuBackend, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu, "MEMINFO_PATH", tmp_path / "missing")
    monkeypatch.setattr(cpu, "CGROUP_LIMIT_PATHS", ())
    free, total = backend.memory_info(HOST)
    assert 0 < free <= total


def test_cpu_name_from_cpuinfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Test CPU 9000\nflags\t: avx2\n")
    monkeypatch.setattr(cpuinfo, "CPUINFO_PATH", info)
    assert cpuinfo.host_cpu_name() == "Test CPU 9000"
    monkeypatch.setattr(cpuinfo, "CPUINFO_PATH", tmp_path / "missing")
    assert cpuinfo.host_cpu_name()


def test_l2_cache_size_from_sysfs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The level-2 data/unified cache is found among sysfs's caches (not L1's or L3's)."""
    for i, (level, kind, size) in enumerate(
        [("1", "Data", "48K"), ("1", "Instruction", "32K"), ("2", "Unified", "1024K"),
         ("3", "Unified", "32768K")]
    ):  # fmt: skip
        d = tmp_path / f"index{i}"
        d.mkdir()
        (d / "level").write_text(level + "\n")
        (d / "type").write_text(kind + "\n")
        (d / "size").write_text(size + "\n")
    monkeypatch.setattr(cpuinfo, "CACHE_PATH", tmp_path)
    assert cpuinfo.l2_cache_bytes() == 1 << 20
    (tmp_path / "index2" / "size").write_text("2M\n")
    assert cpuinfo.l2_cache_bytes() == 2 << 20
    (tmp_path / "index2" / "size").write_text("lots\n")
    assert cpuinfo.l2_cache_bytes() is None
    monkeypatch.setattr(cpuinfo, "CACHE_PATH", tmp_path / "missing")
    assert cpuinfo.l2_cache_bytes() is None


@pytest.mark.parametrize("shape", [(4, 8), torch.Size([2, 3, 5])])
def test_pinned_empty_is_a_host_buffer(
    backend: CpuBackend, shape: tuple[int, ...] | torch.Size
) -> None:
    buffer = backend.pinned_empty(shape, torch.float16)
    assert buffer.shape == torch.Size(shape)
    assert buffer.dtype == torch.float16
    assert buffer.device == HOST
    assert not buffer.is_pinned()  # nothing to pin for without an accelerator


@pytest.mark.parametrize("non_blocking", [False, True])
def test_copy_host_to_host(backend: CpuBackend, non_blocking: bool) -> None:
    src = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    dst = backend.pinned_empty(src.shape, src.dtype)
    backend.copy(dst, src, non_blocking=non_blocking)
    backend.synchronize(HOST)
    assert torch.equal(dst, src)
    strided = torch.zeros(4, 3, 2).permute(2, 1, 0)  # non-contiguous destination
    backend.copy(strided, src)
    assert torch.equal(strided, src)


def test_copy_refuses_to_broadcast_convert_or_cross_kinds(backend: CpuBackend) -> None:
    src = torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"dst \(3, 2\) torch.float32 and src \(2, 3\)"):
        backend.copy(torch.empty(3, 2), src)
    with pytest.raises(ValueError, match="matching tensors"):
        backend.copy(torch.empty(2, 3, dtype=torch.float16), src)
    with pytest.raises(ValueError, match="cannot copy a tensor on meta"):
        backend.copy(torch.empty(2, 3, device="meta"), src)


@pytest.mark.parametrize("rows", [1, 7, 32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_kernel_equals_f_linear(backend: CpuBackend, rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 24, generator=gen)
    bias = torch.randn(48, generator=gen) if with_bias else None
    kernel = backend.linear_kernel(weight, bias)
    if not torch.backends.mkldnn.is_available():
        assert kernel is None
        return
    assert kernel is not None
    x = torch.randn(rows, 24, generator=gen)
    expected = torch.nn.functional.linear(x, weight, bias)
    weight.zero_()  # the kernel holds its own copy
    with torch.inference_mode():
        torch.testing.assert_close(kernel(x), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "flags", [frozenset({"avx2"}), frozenset({"avx512_bf16"}), frozenset({"amx_bf16"})]
)
def test_a_bfloat16_linear_kernel_only_with_native_bf16(
    backend: CpuBackend, flags: frozenset[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """bfloat16 weights get the packed kernel where the CPU has native bf16 matmuls, AMX or
    AVX-512 BF16 (1.6x F.linear at a decode step's rows with AMX, 1.2-1.7x at 1-64 rows on
    a Zen 5 EPYC), F.linear elsewhere (emulated bf16); float16 never. The flags are
    injected, and so is the packing where this CPU cannot reorder bfloat16 weights (oneDNN
    needs AVX-512 BW/VL/DQ for it): a fake standing in for such a CPU, which records what
    it packed."""
    import backends.cpu

    monkeypatch.setattr(backends.cpu, "native_bf16", lambda: bool(flags & NATIVE_BF16))
    packed: list[torch.dtype] = []
    fake = not {"avx512bw", "avx512vl", "avx512dq"} <= cpu_flags()
    if fake:

        def fake_packed_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Any:
            packed.append(weight.dtype)
            return torch.nn.functional.linear

        monkeypatch.setattr(backends.cpu, "packed_linear", fake_packed_linear)
    assert backend.linear_kernel(torch.zeros(4, 4, dtype=torch.float16), None) is None
    kernel = backend.linear_kernel(torch.zeros(4, 4, dtype=torch.bfloat16), None)
    native = bool(flags & NATIVE_BF16) and torch.backends.mkldnn.is_available()
    assert (kernel is not None) == native
    assert packed == ([torch.bfloat16] if fake and native else [])


@pytest.mark.skipif(
    not cpu_flags() & NATIVE_BF16 or not torch.backends.mkldnn.is_available(),
    reason="bfloat16 weights are packed only where the CPU has AMX or AVX-512 BF16",
)
def test_a_bfloat16_weight_onednn_cannot_pack_falls_back_to_f_linear() -> None:
    """The CPU's flags say native bf16, but oneDNN is held to AVX2 (ONEDNN_MAX_CPU_ISA, read
    once per process: a child) and refuses to reorder bf16 weights: the layer keeps
    F.linear rather than failing the engine's load."""
    code = (
        "import torch\n"
        "from backends import get_backend\n"
        "w = torch.randn(8, 16).bfloat16()\n"
        "k = get_backend('cpu').linear_kernel(w, None)\n"
        "print('none' if k is None else 'kernel')\n"
    )
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "none"


@pytest.mark.skipif(
    not cpu_flags() & NATIVE_BF16 or not torch.backends.mkldnn.is_available(),
    reason="the bfloat16 kernel runs where the CPU has AMX or AVX-512 BF16",
)
@pytest.mark.parametrize("rows", [1, 16, 64, 300])
def test_bfloat16_linear_kernel_equals_f_linear_within_a_rounding(
    backend: CpuBackend, rows: int
) -> None:
    """Both accumulate in float32 and round the output once to bfloat16: at most one bf16
    step apart from float32 math over the same bf16 values, as F.linear is."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 64, generator=gen).bfloat16()
    bias = torch.randn(96, generator=gen).bfloat16()
    kernel = backend.linear_kernel(weight, bias)
    assert kernel is not None
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    exact = torch.nn.functional.linear(x.float(), weight.float(), bias.float())
    with torch.inference_mode():
        got = kernel(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    torch.testing.assert_close(got.float(), exact, rtol=1.6e-2, atol=2e-2)
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias), rtol=1.6e-2,
                               atol=2e-2)  # fmt: skip

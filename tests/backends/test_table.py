"""The `hetero-pd devices` table and its role hints."""

from __future__ import annotations

from backends import CapabilityProfile, devices_report, format_devices_table, role_hints

HEADER = ("device", "name", "memory GiB", "fp32 GFLOP/s", "half GFLOP/s", "GB/s", "role")


def _profile(
    kind: str, index: int, fp32: float, half: float | None, gbps: float, name: str = "X"
) -> CapabilityProfile:
    return CapabilityProfile(kind, index, name, fp32, half, gbps, 80 << 30, 0)


# Compute-rich and bandwidth-rich accelerators (FLOP per byte 1000 and 100), and a host.
NPU = _profile("npu", 0, 80_000.0, 300_000.0, 300.0, "Ascend910B2")
GPU = _profile("cuda", 1, 50_000.0, 330_000.0, 3_300.0, "NVIDIA H100 80GB HBM3")
HOST = CapabilityProfile("cpu", 0, "Test CPU", 60.0, None, 12.0, 16 << 30, 2)


def test_single_device_is_either() -> None:
    assert role_hints([GPU]) == ["either"]
    assert role_hints([]) == []


def test_roles_follow_comparative_advantage() -> None:
    assert role_hints([NPU, GPU]) == ["prefill", "decode"]
    # The host is not a candidate next to accelerators and does not shift their hints.
    assert role_hints([NPU, GPU, HOST]) == ["prefill", "decode", "either"]
    # Without accelerators hosts are compared with each other (as in a cluster-wide table).
    assert role_hints([HOST, _profile("cpu", 1, 10.0, None, 1.0)]) == ["decode", "prefill"]
    twin = _profile("cuda", 2, 50_000.0, 330_000.0, 3_300.0)
    assert role_hints([GPU, twin]) == ["either", "either"]


def test_table_is_aligned_and_complete() -> None:
    text = format_devices_table([NPU, GPU, HOST])
    lines = text.splitlines()
    assert len(lines) == 5
    for column in HEADER:
        assert column in lines[0]
    assert set(lines[1]) <= {"-", " "}
    npu_row, gpu_row, host_row = lines[2:]
    assert npu_row.startswith("npu:0") and npu_row.endswith("prefill")
    assert "NVIDIA H100 80GB HBM3" in gpu_row and gpu_row.endswith("decode")
    assert host_row.startswith("cpu ") and "Test CPU" in host_row and host_row.endswith("either")
    assert "80.0" in npu_row and "16.0" in host_row  # GiB
    assert "300,000.0" in npu_row and "3,300.0" in gpu_row
    # Numeric columns are right-aligned: every row ends its "GB/s" cell at the same place.
    gbps_end = lines[0].index("GB/s") + len("GB/s")
    for row, value in zip(lines[2:], ("300.0", "3,300.0", "12.0"), strict=True):
        assert row[gbps_end - len(value) : gbps_end] == value
    # Missing half-precision measurement shows as "-".
    half_end = lines[0].index("half GFLOP/s") + len("half GFLOP/s")
    assert host_row[half_end - 1] == "-"


def test_empty_table_has_header_only() -> None:
    assert format_devices_table([]).splitlines()[0].split("  ")[0] == "device"
    assert len(format_devices_table([]).splitlines()) == 2


def test_devices_report_profiles_this_host() -> None:
    lines = devices_report().splitlines()
    assert lines[0].startswith("device")
    assert lines[2].startswith("cpu ")
    assert lines[2].rstrip().endswith(("either", "prefill", "decode"))

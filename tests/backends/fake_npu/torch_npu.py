"""FAKE torch_npu for tests: stands in for Ascend hardware, which CI machines do not have.

It mimics the part of torch_npu's documented surface that `backends.npu` uses (a `npu`
namespace with is_available, device_count, get_device_name, synchronize, mem_get_info,
is_bf16_supported, Stream, Event) and records every call in `npu.calls`. The device count comes from
FAKE_TORCH_NPU_DEVICES (default 2).

With FAKE_TORCH_NPU_REGISTER=1 it also does what the real torch_npu does on import: renames
torch's PrivateUse1 device type to "npu" and installs `torch.npu`. That is process-wide and
irreversible, so only child interpreters set it, never the pytest process.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

import torch

DEVICE_COUNT = int(os.environ.get("FAKE_TORCH_NPU_DEVICES", "2"))
BF16 = os.environ.get("FAKE_TORCH_NPU_BF16", "1") == "1"  # an Atlas A2 (910B) has bfloat16
FREE_BYTES = 30 << 30
TOTAL_BYTES = 64 << 30

npu = ModuleType("torch_npu.npu")
calls: list[tuple[Any, ...]] = []
npu.calls = calls  # type: ignore[attr-defined]


def _is_available() -> bool:
    calls.append(("is_available",))
    return DEVICE_COUNT > 0


def _device_count() -> int:
    calls.append(("device_count",))
    return DEVICE_COUNT


def _get_device_name(device: Any = None) -> str:
    calls.append(("get_device_name", device))
    return "Ascend910B2"


def _synchronize(device: Any = None) -> None:
    calls.append(("synchronize", device))


def _mem_get_info(device: Any = None) -> tuple[int, int]:
    calls.append(("mem_get_info", device))
    return FREE_BYTES, TOTAL_BYTES


class Stream:
    """Fake torch.npu.Stream: remembers its device."""

    def __init__(self, device: Any = None, priority: int = 0) -> None:
        calls.append(("Stream", device))
        self.device = device
        self.priority = priority


def _is_bf16_supported() -> bool:
    calls.append(("is_bf16_supported",))
    return BF16


class Event:
    """Fake torch.npu.Event: remembers whether timing was asked for."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        calls.append(("Event", enable_timing))
        self.enable_timing = enable_timing


npu.is_available = _is_available  # type: ignore[attr-defined]
npu.device_count = _device_count  # type: ignore[attr-defined]
npu.get_device_name = _get_device_name  # type: ignore[attr-defined]
npu.synchronize = _synchronize  # type: ignore[attr-defined]
npu.mem_get_info = _mem_get_info  # type: ignore[attr-defined]
npu.is_bf16_supported = _is_bf16_supported  # type: ignore[attr-defined]
npu.Stream = Stream  # type: ignore[attr-defined]
npu.Event = Event  # type: ignore[attr-defined]

if os.environ.get("FAKE_TORCH_NPU_REGISTER") == "1":
    torch.utils.rename_privateuse1_backend("npu")
    torch.npu = npu  # type: ignore[attr-defined]

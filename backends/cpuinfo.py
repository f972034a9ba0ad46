"""What /proc/cpuinfo says of this host's CPU: its model name and feature flags."""

from __future__ import annotations

import platform
from pathlib import Path

CPUINFO_PATH = Path("/proc/cpuinfo")


def _cpuinfo_field(*keys: str) -> str | None:
    """The first non-empty value of any of `keys` in /proc/cpuinfo, or None."""
    try:
        for line in CPUINFO_PATH.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in keys and value.strip():
                return value.strip()
    except OSError:
        pass
    return None


def host_cpu_name() -> str:
    """CPU model name ("Intel(R) Xeon(R) ..."), falling back to the architecture."""
    return (
        _cpuinfo_field("model name", "Model") or platform.processor() or platform.machine() or "cpu"
    )


def cpu_flags() -> frozenset[str]:
    """Feature flags of the first processor: "flags" on x86, "Features" on Arm."""
    return frozenset((_cpuinfo_field("flags", "Features") or "").split())


CACHE_PATH = Path("/sys/devices/system/cpu/cpu0/cache")


def l2_cache_bytes() -> int | None:
    """The first core's level-2 data (or unified) cache in bytes, as sysfs lists it; None
    where sysfs does not say."""
    try:
        for index in sorted(CACHE_PATH.glob("index*")):
            level = (index / "level").read_text().strip()
            kind = (index / "type").read_text().strip()
            if level == "2" and kind in ("Unified", "Data"):
                return _size_bytes((index / "size").read_text().strip())
    except (OSError, ValueError):
        pass
    return None


def _size_bytes(text: str) -> int:
    """sysfs's "1024K" / "2M" / "512" as bytes."""
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
    return int(text[:-1] if scale > 1 else text) * scale

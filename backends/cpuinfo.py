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

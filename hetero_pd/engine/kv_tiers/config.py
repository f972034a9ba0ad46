"""TierConfig: sizes and place of the prefix-cache tiers below the device's KV blocks."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

GB = 2**30


@dataclass(frozen=True, slots=True)
class TierConfig:
    """Host DRAM holds `host_bytes` of KV blocks; an SSD folder `disk_path` holds up to
    `disk_bytes` more (it is filled from the host tier, so it needs one). A block goes down
    once requests have used it `admit_after` times (computed or hit)."""

    host_bytes: int
    disk_bytes: int = 0
    disk_path: Path | None = None
    admit_after: int = 2

    def __post_init__(self) -> None:
        if self.host_bytes <= 0:
            raise ValueError(f"the host KV tier needs a size > 0, got {self.host_bytes} bytes")
        if self.disk_bytes < 0:
            raise ValueError(f"the SSD KV tier size must be >= 0, got {self.disk_bytes} bytes")
        if self.disk_bytes and self.disk_path is None:
            raise ValueError("kv_cache_disk_gb > 0 needs kv_cache_disk_path (an SSD folder)")
        if self.admit_after < 1:
            raise ValueError(f"kv_cache_admit_after must be >= 1, got {self.admit_after}")

    @classmethod
    def from_options(
        cls,
        host_gb: float,
        disk_gb: float,
        disk_path: str | None,
        caching: bool,
        admit_after: int = 2,
    ) -> TierConfig | None:
        """The tiers an engine's `kv_cache_*` options ask for (None: no tiers), with an
        error naming the option that is wrong."""
        for name, value in (("kv_cache_host_gb", host_gb), ("kv_cache_disk_gb", disk_gb)):
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value!r}")
        if admit_after < 1:
            raise ValueError(f"kv_cache_admit_after must be >= 1, got {admit_after!r}")
        if not host_gb and not disk_gb:
            return None
        if not host_gb:
            raise ValueError(
                "kv_cache_disk_gb needs kv_cache_host_gb > 0: the SSD tier is filled from "
                "the host-DRAM tier"
            )
        if not caching:
            raise ValueError(
                "kv_cache_host_gb/kv_cache_disk_gb hold prefix-cache blocks: they need "
                "enable_prefix_caching (and no edge split, start_layer=0)"
            )
        path = Path(disk_path).expanduser() if disk_path and disk_gb else None
        return cls(int(host_gb * GB), int(disk_gb * GB), path, admit_after)

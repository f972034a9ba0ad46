"""What the KV tiers report: hits and bytes per tier, onload times (engine.kv_tier_stats())."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class TierStats:
    """One tier. `hits` count blocks brought up from it for a request; `writes` count blocks
    copied into it; `stored_*` is what it holds now, out of `capacity_bytes`."""

    hits: int
    hit_bytes: int
    writes: int
    write_bytes: int
    evictions: int
    stored_blocks: int
    stored_bytes: int
    capacity_bytes: int


@dataclass(frozen=True, slots=True)
class KVTierStats:
    """The device's prefix-cache hits (blocks a request found on the device, including those
    just brought up) and the host-DRAM and SSD tiers below it (`disk` None without one)."""

    device_hits: int
    device_hit_bytes: int
    host: TierStats
    disk: TierStats | None
    disk_corrupt: int  # SSD blocks that failed validation on load: served as misses
    offloads_skipped: int  # blocks not copied down because every host slot was busy
    onloads: int  # requests whose prefix was brought up from the tiers
    onload_blocks: int
    onload_seconds_total: float  # from the lookup to the KV being on the device
    onload_seconds_max: float

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (JSON/msgpack friendly)."""
        return asdict(self)

"""Prefix-cache tiers below the device's KV blocks: host DRAM, then an SSD folder.

    device blocks (BlockPool) --freed, seen twice--> host slots (HostTier) --write--> SSD files
            ^                                              |                            |
            +------------ onload before the request runs --+<------ read, checked ------+

`build_kv_tiers` makes them for an engine; the KV cache manager drives them.
"""

from __future__ import annotations

from pathlib import Path

import torch

from backends import backend_for
from hetero_pd.engine.kv_tiers.config import TierConfig
from hetero_pd.engine.kv_tiers.disk import DiskTier, process_key
from hetero_pd.engine.kv_tiers.host import HostTier
from hetero_pd.engine.kv_tiers.mover import TierMover
from hetero_pd.engine.kv_tiers.namespace import kv_namespace
from hetero_pd.engine.kv_tiers.stats import KVTierStats, TierStats
from hetero_pd.engine.kv_tiers.tiers import KVTiers

__all__ = ["KVTierStats", "KVTiers", "TierConfig", "TierStats", "build_kv_tiers"]


def build_kv_tiers(
    config: TierConfig,
    model_path: Path,
    kv_tensors: list[torch.Tensor],
    kv_layout: str = "nd",
    disk_key: bytes | None = None,
) -> KVTiers:
    """Tiers for the device KV `kv_tensors` ([K0, V0, K1, ...], each [num_blocks, *block])
    of the model in `model_path`; a host slot holds one block of every tensor. The SSD
    tier's files are sealed with `disk_key` (a deployment's; None: one per process)."""
    first = kv_tensors[0]
    backend = backend_for(first.device)
    block_shape = tuple(first.shape[1:])
    block_bytes = len(kv_tensors) * first[0].numel() * first.element_size()
    num_slots = config.host_bytes // block_bytes
    if num_slots < 1:
        raise ValueError(
            f"kv_cache_host_gb={config.host_bytes / 2**30:g} holds no KV block "
            f"(one block is {block_bytes} bytes)"
        )
    buffer = backend.pinned_empty((num_slots, len(kv_tensors), *block_shape), first.dtype)
    host = HostTier(buffer)
    disk = None
    if config.disk_bytes:
        assert config.disk_path is not None
        namespace = kv_namespace(model_path, first.dtype, block_shape, len(kv_tensors), kv_layout)
        key = disk_key or process_key()
        disk = DiskTier(config.disk_path, namespace, config.disk_bytes, block_bytes, key)
    mover = TierMover(host, disk, kv_tensors, backend)
    return KVTiers(host, disk, mover, backend, config.admit_after)

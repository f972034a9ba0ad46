"""Every HETERO_PD_* environment variable the transfer engine reads, in one place (it
imports nothing of hetero_pd, so hetero_pd/envs.py cannot hold these)."""

from __future__ import annotations

import os
from pathlib import Path


def transfer_settings() -> dict[str, object]:
    """`TransferConfig.from_env`'s values: $HETERO_PD_TRANSFER_SECRET (the shared secret),
    $HETERO_PD_TRANSFER_HOST and $HETERO_PD_TRANSFER_ADVERTISE_HOST, those that are set."""
    values: dict[str, object] = {}
    secret = os.environ.get("HETERO_PD_TRANSFER_SECRET")
    if secret:
        values["secret"] = secret.encode()
    for name, key in (("HOST", "host"), ("ADVERTISE_HOST", "advertise_host")):
        value = os.environ.get(f"HETERO_PD_TRANSFER_{name}")
        if value:
            values[key] = value
    return values


def hash_inline_bytes() -> int:
    """$HETERO_PD_HASH_INLINE_BYTES: chunks up to this size are hashed on the calling thread
    (default 64 MiB)."""
    return int(os.environ.get("HETERO_PD_HASH_INLINE_BYTES", 64 << 20))


def hash_piece_bytes(l2_bytes: int | None) -> int:
    """$HETERO_PD_HASH_PIECE_BYTES: the data channel hashes a chunk in pieces of this size,
    each right after the kernel copied it (sending) or wrote it (receiving), while it is in
    this core's cache. Default: three quarters of the core's L2 cache (``l2_bytes``; 768 KiB
    where it is unknown), kept within 256 KiB - 2 MiB. A piece as large as the L2 left it
    half evicted by the kernel's own copy: on a Zen 5 core (1 MiB L2) 1 MiB pieces cost
    0.22-0.32 of a tcp push's time, 768 KiB ones 0.02-0.13 (docs/BENCHMARKS.md, section 2)."""
    env = os.environ.get("HETERO_PD_HASH_PIECE_BYTES")
    if env:
        value = int(env)
        if value < 4096:
            raise ValueError(f"HETERO_PD_HASH_PIECE_BYTES={env}: need at least 4096")
        return value
    if not l2_bytes:
        return 768 << 10
    return min(max(l2_bytes * 3 // 4, 256 << 10), 2 << 20)


def native_hash() -> bool:
    """$HETERO_PD_NATIVE_HASH: "0" keeps checksums in Python (the `xxhash` package) instead
    of the C loops that hash KV as they move it (backends/xxh3_io.py; default on)."""
    return os.environ.get("HETERO_PD_NATIVE_HASH", "1").strip() != "0"


def private_dir() -> Path | None:
    """$HETERO_PD_PRIVATE_DIR: a folder only this uid can reach (a pod's own /tmp), taken as
    it is above the kernel folder (as hetero_pd.envs.private_dir(), which this package
    cannot import)."""
    env = os.environ.get("HETERO_PD_PRIVATE_DIR")
    return Path(env) if env else None


def kernel_dir() -> Path:
    """Where the C kernels are built and loaded from: `kernels/` under
    $HETERO_PD_COMPILE_CACHE_DIR, else $HETERO_PD_CACHE_DIR, else ~/.cache/hetero-pd (as
    hetero_pd.envs.compile_cache_dir(), which this package cannot import)."""
    env = os.environ.get("HETERO_PD_COMPILE_CACHE_DIR") or os.environ.get("HETERO_PD_CACHE_DIR")
    return (Path(env) if env else Path.home() / ".cache" / "hetero-pd") / "kernels"

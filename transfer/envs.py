"""Every HETERO_PD_* environment variable the transfer engine reads, in one place (it
imports nothing of hetero_pd, so hetero_pd/envs.py cannot hold these)."""

from __future__ import annotations

import os


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

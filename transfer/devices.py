"""The transfer module's only door to device code: ``backends``.

Only host (CPU) tensors are touched directly here; anything on a device is staged through
the owning backend's pinned memory and copies. The C loops that hash KV as they move it
(``backends.xxh3_io``) come through here too.
"""

from __future__ import annotations

import numpy as np
import torch

from backends import Backend, backend_for, native, xxh3_io
from backends.xxh3_io import Xxh3Io
from transfer import envs

__all__ = ["Backend", "Xxh3Io", "address", "backend_for", "hash_io", "to_host"]


def to_host(chunk: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor with ``chunk``'s data (pinned staging for device tensors)."""
    if chunk.device.type == "cpu":
        return chunk.contiguous()
    backend = backend_for(chunk.device)
    staging = backend.pinned_empty(tuple(chunk.shape), chunk.dtype)
    backend.copy(staging, chunk.contiguous())
    backend.synchronize(chunk.device)
    return staging


_hash_io: Xxh3Io | None = None


def hash_io(wait: float | None = 0.0) -> Xxh3Io | None:
    """xxh3 fused with the copies of direct writes (``backends.xxh3_io``), built in the
    background on the first call (an engine's start); None until it is there, where it
    cannot be built, or with $HETERO_PD_NATIVE_HASH=0: then checksums run in Python, with the
    same digests. ``wait``: seconds to wait for the build (None: until it ends)."""
    global _hash_io
    if not envs.native_hash():
        return None
    if _hash_io is not None:
        return _hash_io
    private = envs.private_dir()
    if private is not None:  # a pod's own /tmp: its kernel folder is below it
        native.trust_private_root(private)
    _hash_io = xxh3_io.loaded(envs.kernel_dir(), wait)
    return _hash_io


def address(view: memoryview) -> int:
    """The address of the first byte of a buffer (read-only ones too), without a copy."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0

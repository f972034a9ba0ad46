"""The transfer module's only door to device code: ``backends``.

Only host (CPU) tensors are touched directly here; anything on a device is staged through
the owning backend's pinned memory and copies.
"""

from __future__ import annotations

import torch

from backends import Backend, backend_for

__all__ = ["Backend", "backend_for", "to_host"]


def to_host(chunk: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor with ``chunk``'s data (pinned staging for device tensors)."""
    if chunk.device.type == "cpu":
        return chunk.contiguous()
    backend = backend_for(chunk.device)
    staging = backend.pinned_empty(tuple(chunk.shape), chunk.dtype)
    backend.copy(staging, chunk.contiguous())
    backend.synchronize(chunk.device)
    return staging

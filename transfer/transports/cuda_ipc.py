"""CUDA IPC transport (same host, CUDA on both sides). UNTESTED: no GPU on the dev machine.

Design, written against ``backends`` for when the hardware is present: the receiver exports
each region tensor's CUDA IPC handle in its region description under ``"ipc"`` (made with
``torch.multiprocessing.reductions.reduce_tensor`` and sent as plain fields, never pickled);
the sender rebuilds the tensors with ``rebuild_cuda_tensor`` and copies blocks device to device
through ``backend.copy`` on its stream, then ``backend.synchronize`` before END.
Until a region publishes ``"ipc"``, :func:`available` is False and TCP (or shm) is used.
"""

from __future__ import annotations

from typing import Any

import torch

from transfer.devices import backend_for
from transfer.errors import StatusCode, TransferError
from transfer.region import KVRegion
from transfer.session import Session


def available(src: KVRegion, desc: dict[str, Any]) -> bool:
    """True when both sides are CUDA and the receiver published IPC handles."""
    if src.tensors[0].device.type != "cuda" or desc.get("dev") != "cuda" or not desc.get("ipc"):
        return False
    return backend_for(src.tensors[0].device).supports_ipc()


def open_region(session: Session, desc: dict[str, Any]) -> list[torch.Tensor]:
    """Open the peer's exported CUDA tensors (not implemented until tested on hardware)."""
    raise TransferError(
        StatusCode.PARAM_INVALID,
        "cuda_ipc transport is not validated on hardware yet; use tcp or shm "
        "(EngineConfig.transports without 'cuda_ipc')",
    )

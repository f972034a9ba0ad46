"""CUDA IPC transport (same host, CUDA on both sides). UNTESTED: no GPU on the dev machine.

Design, written against ``backends`` for when the hardware is present: the receiver exports
each region tensor's CUDA IPC handle in its region description (a field of
:class:`~transfer.messages.RegionInfo` still to add, made with
``torch.multiprocessing.reductions.reduce_tensor`` and sent as plain fields, never pickled);
the sender rebuilds the tensors with ``rebuild_cuda_tensor`` and copies blocks device to device
through ``backend.copy`` on its stream, then ``backend.synchronize`` before END.
Until regions publish IPC handles, :func:`available` is False and TCP (or shm) is used.
"""

from __future__ import annotations

import torch

from transfer.errors import StatusCode, TransferError
from transfer.messages import RegionInfo
from transfer.region import KVRegion
from transfer.session import Session

NAME = "cuda_ipc"
SAME_HOST = True


def available(session: Session, src: KVRegion, desc: RegionInfo) -> bool:
    """True when both sides are CUDA and the receiver published IPC handles: never yet, as
    region descriptions carry none (once they do: ``backend_for(device).supports_ipc()``)."""
    return False


def open_region(session: Session, desc: RegionInfo) -> list[torch.Tensor]:
    """Open the peer's exported CUDA tensors (not implemented until tested on hardware)."""
    raise TransferError(
        StatusCode.PARAM_INVALID,
        "cuda_ipc transport is not validated on hardware yet; use tcp or shm "
        "(TransferConfig.transports without 'cuda_ipc')",
    )

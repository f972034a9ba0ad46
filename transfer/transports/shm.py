"""Shared-memory transport: map the receiver's /dev/shm region and write its blocks directly.

The receiver allocated its region with ``KVRegion.allocate(..., shared=True)``; its
description lists one file per tensor. The sender maps each file once per session
(``MAP_SHARED | MAP_POPULATE``, so the first transfer does not pay page faults) and copies
source blocks straight into the destination blocks: one copy, no staging.
"""

from __future__ import annotations

import math
import mmap
import os
from typing import Any

import torch

from transfer.errors import StatusCode, TransferError
from transfer.region import SHM_ROOT, KVRegion, parse_dtype
from transfer.session import Session


def available(src: KVRegion, desc: dict[str, Any]) -> bool:
    """True when the destination lives in /dev/shm and the source is host memory."""
    paths = desc.get("paths")
    return bool(paths) and src.tensors[0].device.type == "cpu"


def open_region(session: Session, desc: dict[str, Any]) -> list[torch.Tensor]:
    """Map the peer's region files as tensors ``[nb, *shape]``."""
    dtype = parse_dtype(desc["dt"])
    shape = (desc["nb"], *desc["shape"])
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    tensors = []
    for path in desc["paths"]:
        real = os.path.realpath(path)
        if os.path.dirname(os.path.dirname(real)) != SHM_ROOT:
            raise TransferError(StatusCode.PARAM_INVALID, f"shm path {path!r} not under {SHM_ROOT}")
        fd = os.open(real, os.O_RDWR)
        try:
            if os.fstat(fd).st_size < nbytes:
                raise TransferError(
                    StatusCode.KV_CACHE_NOT_EXIST, f"{path} is smaller than its region"
                )
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        tensors.append(torch.frombuffer(mm, dtype=torch.uint8).view(dtype).view(shape))
    return tensors

"""Shared-memory transport: map the receiver's /dev/shm region and write its blocks directly.

The receiver allocated its region with ``KVRegion.allocate(..., shared=True)`` and told us,
after mutual authentication, only the random token of its directory. We build the path from
the *authenticated* peer's pid and that token, and map the files only if the directory is a
real directory of our user whose ``owner`` file names the peer's engine id: a peer can
never make us write into a path it merely names. Each file is mapped once per session
(``MAP_SHARED | MAP_POPULATE``, so the first transfer does not pay page faults) and source
blocks are copied straight into the destination blocks: one copy, no staging.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import stat

import torch

from transfer.errors import StatusCode, TransferError
from transfer.messages import RegionInfo
from transfer.region import OWNER_FILE, SHM_PREFIX, SHM_ROOT, KVRegion, parse_dtype
from transfer.session import Session

NAME = "shm"
SAME_HOST = True
_TOKEN = re.compile(r"[0-9a-f]{8}")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


def available(session: Session, src: KVRegion, desc: RegionInfo) -> bool:
    """True when the destination lives in /dev/shm and the source is host memory."""
    return bool(desc.shm) and src.tensors[0].device.type == "cpu"


def peer_directory(session: Session, desc: RegionInfo) -> str:
    """The peer's own region directory, verified; raises NOT_GRANTED otherwise."""
    token, name = desc.shm, desc.name
    if not (token is not None and _TOKEN.fullmatch(token)):
        raise _refuse(session, f"shm token {token!r}")
    if not _NAME.fullmatch(name):
        raise _refuse(session, f"region name {name!r}")
    root = os.path.join(SHM_ROOT, f"{SHM_PREFIX}-{session.pid}-{token}")
    try:
        st = os.lstat(root)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
            raise _refuse(session, f"{root} is not a directory of this user")
        fd = os.open(os.path.join(root, OWNER_FILE), os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd) as f:
            owner = f.read(256)
    except OSError as exc:
        raise _refuse(session, f"{root}: {exc.strerror}") from None
    if owner != session.peer_id:
        raise _refuse(session, f"{root} belongs to engine {owner!r}")
    return root


def open_region(session: Session, desc: RegionInfo) -> list[torch.Tensor]:
    """Map the peer's region files as tensors ``[nb, *shape]``."""
    root = peer_directory(session, desc)
    dtype = parse_dtype(desc.dtype)
    shape = (desc.num_blocks, *desc.block_shape)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    tensors = []
    for i in range(desc.num_layers * desc.tensors_per_layer):
        path = os.path.join(root, f"{desc.name}.{i}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise _refuse(session, f"{path}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size < nbytes:
                raise TransferError(
                    StatusCode.KV_CACHE_NOT_EXIST, f"{path} is not a file of its region's size"
                )
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        finally:
            os.close(fd)
        tensors.append(torch.frombuffer(mm, dtype=torch.uint8).view(dtype).view(shape))
    return tensors


def _refuse(session: Session, why: str) -> TransferError:
    return TransferError(
        StatusCode.NOT_GRANTED,
        f"will not map shared memory of peer {session.peer_id!r} (pid {session.pid}): {why}",
    )

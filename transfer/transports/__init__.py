"""Transports: how the bytes of a transfer travel once the control plane agreed on it.

============  ===========================================  ==================================
name          when                                         data path
============  ===========================================  ==================================
``local``     peer engine in this process                  device copy src -> dst blocks
``cuda_ipc``  same host, CUDA on both sides (UNTESTED)     device copy into IPC-opened memory
``shm``       same host, receiver region in /dev/shm       one CPU copy into mapped dst blocks
``tcp``       anything else (or when forced)               chunks on the TCP data channel
============  ===========================================  ==================================

``local``, ``cuda_ipc`` and ``shm`` are *direct*: the sender writes destination blocks
itself inside a window the receiver granted. ``tcp`` is a *stream*: chunks, with their begin
and end, on the session's data channel (:mod:`transfer.datachan`; ZMQ frames when it is off).
Grants, ACKs and errors always go over the engines' ZMQ link.
"""

from __future__ import annotations

import torch

from transfer.messages import RegionInfo
from transfer.region import KVRegion
from transfer.session import Session
from transfer.transports import cuda_ipc, local, shm

DIRECT = frozenset({"local", "cuda_ipc", "shm"})


def choose(
    allowed: tuple[str, ...],
    forced: str | None,
    session: Session,
    my_host: str,
    src: KVRegion,
    dst_desc: RegionInfo,
) -> str:
    """Pick the best transport for sending ``src`` blocks to the peer's ``dst_desc`` region."""
    order = (forced,) if forced else allowed
    same_host = session.host == my_host
    for name in order:
        if name == "local" and same_host and local.available(session, dst_desc):
            return name
        if name == "cuda_ipc" and same_host and cuda_ipc.available(src, dst_desc):
            return name
        if name == "shm" and same_host and shm.available(src, dst_desc):
            return name
        if name == "tcp":
            return name
    raise ValueError(f"transport {forced!r} cannot reach peer {session.peer_id!r} from here")


def open_destination(name: str, session: Session, desc: RegionInfo) -> list[torch.Tensor]:
    """Destination tensors of a direct transport (cached per session)."""
    key = f"{name}:{desc.name}"
    tensors = session.mapped.get(key)
    if tensors is None:
        opener = {
            "local": local.open_region,
            "shm": shm.open_region,
            "cuda_ipc": cuda_ipc.open_region,
        }
        tensors = opener[name](session, desc)
        session.mapped[key] = tensors
    return tensors

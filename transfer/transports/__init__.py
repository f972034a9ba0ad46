"""Transports: how the bytes of a transfer travel once the control plane agreed on it.

============  ===========================================  ==================================
name          when                                         data path
============  ===========================================  ==================================
``local``     peer engine in this process                  device copy src -> dst blocks
``cuda_ipc``  same host, CUDA on both sides (UNTESTED)     device copy into IPC-opened memory
``shm``       same host, receiver region in /dev/shm       one CPU copy into mapped dst blocks
``tcp``       anything else (or when forced)               chunks on the TCP data channel
============  ===========================================  ==================================

Each is a module that is a :class:`Transport` (``NAME``, ``SAME_HOST``, ``available``); the
sender picks the first available one of its configured order with :func:`choose`, never by
name. ``local``, ``cuda_ipc`` and ``shm`` are :class:`DirectTransport`\\ s: they also map the
peer's region (``open_region``) and the sender writes destination blocks itself, inside a
window the receiver granted (:mod:`transfer.transports.direct`). ``tcp`` is a *stream*:
chunks, with their begin and end, on the session's data channel (:mod:`transfer.transports.tcp`;
ZMQ frames when it is off). Grants, ACKs and errors always go over the engines' ZMQ link::

    choose(order, session, src, dst) ──> DirectTransport: GRANT ─> open_destination ─> direct
                                    └──> tcp:             BEGIN / DATA / END ─> tcp.stream
"""

from __future__ import annotations

from typing import Protocol

import torch

from transfer.errors import StatusCode, TransferError
from transfer.messages import RegionInfo
from transfer.region import KVRegion
from transfer.session import Session
from transfer.transports import cuda_ipc, local, shm, tcp


class Transport(Protocol):
    """One way to move a transfer's bytes (each transport module is one)."""

    #: Its name in ``TransferConfig.transports`` and in BEGIN's ``mode``.
    NAME: str
    #: It reaches only peers on this host (``Session.host`` equals ours).
    SAME_HOST: bool

    def available(self, session: Session, src: KVRegion, desc: RegionInfo) -> bool:
        """Whether it can move ``src`` blocks into the peer's region ``desc`` now."""
        ...


class DirectTransport(Transport, Protocol):
    """A transport whose sender writes the receiver's blocks itself."""

    def open_region(self, session: Session, desc: RegionInfo) -> list[torch.Tensor]:
        """The peer's region ``desc`` as tensors ``[num_blocks, *block_shape]`` we may write."""
        ...


DIRECT_TRANSPORTS: dict[str, DirectTransport] = {"local": local, "cuda_ipc": cuda_ipc, "shm": shm}
TRANSPORTS: dict[str, Transport] = {**DIRECT_TRANSPORTS, "tcp": tcp}
DIRECT = frozenset(DIRECT_TRANSPORTS)


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
        transport = TRANSPORTS.get(name)
        if transport is None or (transport.SAME_HOST and not same_host):
            continue
        if transport.available(session, src, dst_desc):
            return name
    raise ValueError(f"transport {forced!r} cannot reach peer {session.peer_id!r} from here")


def open_destination(name: str, session: Session, desc: RegionInfo) -> list[torch.Tensor]:
    """Destination tensors of direct transport ``name`` (mapped once per session; the
    mappings go when the session does). KV_CACHE_NOT_EXIST when they cannot be opened."""
    key = f"{name}:{desc.name}"
    tensors = session.mapped.get(key)
    if tensors is None:
        try:
            tensors = DIRECT_TRANSPORTS[name].open_region(session, desc)
        except (OSError, KeyError) as exc:  # KeyError: an in-process peer closed meanwhile
            why = f"cannot open peer region: {exc}"
            raise TransferError(StatusCode.KV_CACHE_NOT_EXIST, why) from None
        session.mapped[key] = tensors
    return tensors

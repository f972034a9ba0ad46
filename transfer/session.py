"""Peers: authenticated sessions and the outbound links that establish them."""

from __future__ import annotations

import concurrent.futures
import itertools
import socket
from dataclasses import dataclass, field
from typing import Any

import torch
import zmq

from transfer import wire
from transfer.aead import Sealer
from transfer.messages import AnyMessage, Challenge, Header, RegionInfo, RoleName, tag
from transfer.replay import Window


@dataclass(frozen=True, slots=True)
class Identity:
    """Who an engine is, as peers learn it (the host, pid and data address only after
    mutual authentication)."""

    engine_id: str
    role: RoleName
    #: This machine and boot (:func:`host_id`): peers on the same one may share /dev/shm.
    host: str
    pid: int
    #: ``host:port`` of our data listener ("" without one).
    data_address: str


def host_id() -> str:
    """Identifies this machine (and boot), so peers can tell they share /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@dataclass(slots=True, eq=False)
class Link:
    """An outbound connection (a DEALER socket) and its handshake state."""

    peer_id: str
    address: str
    socket: zmq.Socket[bytes]
    nonce: bytes
    waiters: list[concurrent.futures.Future[None]] = field(default_factory=list)
    session: Session | None = None
    #: The listening side's CHALLENGE, once it proved the secret (this link's: ``secret``).
    peer_hello: Challenge | None = None
    secret: bytes = b""


@dataclass(slots=True, eq=False)
class Session:
    """An authenticated peer. Frames both ways carry ``token``.

    Outbound sessions (we linked) send on ``link.socket``; inbound ones (the peer linked to
    us) send through our ROUTER to ``identity``. Either kind may push, pull and ACK.
    """

    peer_id: str
    role: str
    host: str
    pid: int
    regions: dict[str, RegionInfo]
    token: bytes
    identity: bytes | None = None
    link: Link | None = None
    alive: bool = True
    #: Destination tensors of the peer's regions opened by a direct transport (shm, local).
    mapped: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    #: ``host:port`` of the peer's data listener ("" when it has none).
    data_address: str = ""
    #: Our data connection to the peer, opened lazily
    #: (:class:`transfer.transports.tcp.data_out.DataOut`).
    data_out: Any = None
    #: The data address could not be connected to: stream transfers use the link.
    data_failed: bool = False
    #: Seals KV chunks both ways when the two ends agreed to (:mod:`transfer.aead`).
    sealer: Sealer | None = None
    #: Control keys (:func:`transfer.auth.control_keys`): ours MACs every frame we send on
    #: the session, the peer's every frame it sends.
    mac_send: bytes = b""
    mac_receive: bytes = b""
    #: Numbers of the headers we send (1, 2, ...) and those the peer's we took: a frame
    #: sent again in the session is refused (:mod:`transfer.replay`).
    numbers: itertools.count[int] = field(default_factory=lambda: itertools.count(1))
    received: Window = field(default_factory=Window)

    def header(self, msg: AnyMessage) -> bytes:
        """``msg`` as a sealed header of this session: its token, its number and our MAC."""
        return wire.encode(msg, self.token, self.mac_send, next(self.numbers))

    def take(self, header: Header) -> None:
        """Takes the number of a header whose MAC verified; "replay" if it was taken."""
        if not self.received.take(header.n):
            raise wire.FrameError("replay", f"{tag(header.msg)} number {header.n} seen before")

    @property
    def outbound(self) -> bool:
        """True when we initiated the link (and so can re-link)."""
        return self.link is not None

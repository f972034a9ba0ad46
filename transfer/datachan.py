"""The data channel: a plain TCP socket per session beside the ZMQ link, for stream transfers.

ZMQ always receives into its own buffers, so the ZMQ stream costs the receiver one more full
copy than the network itself. On the data channel the receiver reads each chunk with
``recv_into`` straight into the destination blocks (:mod:`transfer.intake`)::

    sender (I/O thread)                                  receiver (I/O thread)
      connect(peer's advertised data address)  ──>  accept; nothing is read but a PREFACE
      PREFACE {session token}                  ──>  token of a live session? else close, count
      MESSAGE BEGIN {stream=n, msgpack begin}  ──>  validate, reserve check (as over ZMQ)
      DATA {n, seq, ti, lo, hi, len, digest} + bytes ─> epoch check; recv_into dst blocks
      MESSAGE END                              ──>  all chunks verified? commit
                                   <── ACK / ERROR over the ZMQ link, as before

BEGIN and END travel in band so the receiver always sees them in order with the chunks.
Both engines advertise ``host:port`` of their data listener in the handshake. Everything is
non-blocking on the I/O thread; frames wait in a bounded per-transfer queue until the kernel
takes them (their source views count as in flight, like ZMQ's zero-copy frames).
"""

from __future__ import annotations

import errno
import itertools
import logging
import socket
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from transfer import dataframe
from transfer.addresses import split_host_port
from transfer.errors import TransferError
from transfer.intake import DataIn
from transfer.session import Session

if TYPE_CHECKING:
    from transfer.core import Core
    from transfer.movers import OutTransfer

log = logging.getLogger(__name__)
Part = bytes | memoryview
#: Unauthenticated data connections kept at once (oldest closed first).
MAX_UNAUTHENTICATED = 64
#: Buffers handed to one ``sendmsg``.
IOV_LIMIT = 64


@dataclass(slots=True, eq=False)
class Pending:
    """One queued frame; ``owner`` holds source views until the kernel took every byte."""

    parts: list[memoryview]
    owner: OutTransfer | None
    size: int


def _socket_for(host: str) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    return sock


class DataOut:
    """Our connection to a peer's data listener (sending side of one session)."""

    def __init__(self, chan: DataChannel, session: Session) -> None:
        self.chan, self.session = chan, session
        host, port = split_host_port(session.data_address, "data address")
        self.sock = _socket_for(host)
        err = self.sock.connect_ex((host, port))
        if err not in (0, errno.EINPROGRESS):
            self.sock.close()
            raise OSError(err, f"data channel to {session.data_address}: {errno.errorcode[err]}")
        self.fd = self.sock.fileno()
        self.queue: deque[Pending] = deque()
        self.offset = 0  # bytes of queue[0] already written
        self.flags = 0
        self.closed = False

    def enqueue(self, parts: Sequence[Part], owner: OutTransfer | None) -> None:
        """Queue one frame and write what the kernel takes now (dropped once closed)."""
        if self.closed:
            return
        views = [memoryview(p).cast("B") for p in parts]
        size = sum(v.nbytes for v in views)
        self.queue.append(Pending(views, owner, size))
        if owner is not None:
            owner.queued += size
        self.flush()

    def flush(self) -> None:
        """Write queued frames until the kernel would block; close on a socket error."""
        while self.queue and not self.closed:
            bufs: list[memoryview] = []
            skip = self.offset
            for frame in itertools.islice(self.queue, IOV_LIMIT // 2):
                for part in frame.parts:
                    if skip >= part.nbytes:
                        skip -= part.nbytes
                        continue
                    bufs.append(part[skip:] if skip else part)
                    skip = 0
            try:
                n = self.sock.sendmsg(bufs)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self.close(f"send failed: {exc}")
                return
            self.offset += n
            while self.queue and self.offset >= self.queue[0].size:
                frame = self.queue.popleft()
                self.offset -= frame.size
                if frame.owner is not None:
                    frame.owner.queued -= frame.size
        self._want(zmq.POLLIN | (zmq.POLLOUT if self.queue else 0))

    def cancel(self, owner: OutTransfer) -> None:
        """Forget ``owner``'s queued frames (closing the connection if one is half written)."""
        if self.queue and self.offset and self.queue[0].owner is owner:
            self.close("a cancelled transfer's frame was half written")
            return
        self.queue = deque(f for f in self.queue if f.owner is not owner)
        owner.queued = 0

    def on_event(self, events: int) -> None:
        if events & zmq.POLLOUT:
            self.flush()
        if events & zmq.POLLIN and not self.closed:
            try:  # the peer never writes here: readable means closed (or misbehaving)
                self.sock.recv(1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                pass
            self.close("peer closed the data connection")

    def _want(self, flags: int) -> None:
        if flags != self.flags and not self.closed:
            self.chan.core.poller.register(self.fd, flags)
            self.flags = flags

    def close(self, reason: str) -> None:
        """Close the socket; queued frames are dropped (their chunks will be NACKed/resent)."""
        if self.closed:
            return
        self.closed = True
        log.debug("data channel to %s closed: %s", self.session.peer_id, reason)
        if self.flags:
            self.chan.core.poller.unregister(self.fd)
        self.chan.outs.pop(self.fd, None)
        self.sock.close()
        for frame in self.queue:
            if frame.owner is not None:
                frame.owner.queued -= frame.size
        self.queue.clear()
        if self.session.data_out is self:
            self.session.data_out = None


class DataChannel:
    """The data listener of one engine and all its data connections (I/O thread only)."""

    def __init__(self, core: Core) -> None:
        self.core = core
        cfg = core.config
        self.listener = _socket_for(cfg.host)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((cfg.host, cfg.data_port))
        self.listener.listen(64)
        port = self.listener.getsockname()[1]
        self.address = f"[{cfg.host}]:{port}" if ":" in cfg.host else f"{cfg.host}:{port}"
        self.fd = self.listener.fileno()
        core.poller.register(self.fd, zmq.POLLIN)
        self.ins: dict[int, DataIn] = {}
        self.outs: dict[int, DataOut] = {}

    def owns(self, fd: int) -> bool:
        """True if ``fd`` is the listener or one of our connections."""
        return fd == self.fd or fd in self.ins or fd in self.outs

    def on_event(self, fd: int, events: int) -> None:
        """Poll readiness on one of our sockets."""
        if fd == self.fd:
            self._accept()
        elif fd in self.ins:
            self.ins[fd].on_readable()
        elif fd in self.outs:
            self.outs[fd].on_event(events)

    def close_fd(self, fd: int) -> None:
        """Close the connection on ``fd`` (after a failure handling it)."""
        conn = self.ins.get(fd) or self.outs.get(fd)
        if conn is not None:
            conn.close("internal error")

    def _accept(self) -> None:
        for _ in range(16):
            try:
                sock, _addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: keep serving what we have
                log.warning("engine %s: data accept failed: %s", self.core.engine_id, exc)
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = DataIn(self.core, sock, self._closed_in)
            self.ins[conn.fd] = conn
            self.core.poller.register(conn.fd, zmq.POLLIN)
            waiting = [c for c in self.ins.values() if c.session is None]
            for stale in waiting[: max(0, len(waiting) - MAX_UNAUTHENTICATED)]:
                self.core.metrics.reject("data_unauthenticated")
                stale.close("too many unauthenticated data connections")

    def _closed_in(self, conn: DataIn) -> None:
        self.core.poller.unregister(conn.fd)
        self.ins.pop(conn.fd, None)

    def send(self, session: Session, parts: list[Part], owner: OutTransfer | None) -> bool:
        """Queue one frame to ``session``'s peer, connecting first if needed."""
        conn = session.data_out
        if conn is None or conn.closed:
            try:
                conn = DataOut(self, session)
            except (OSError, TransferError) as exc:
                log.debug("engine %s: %s", self.core.engine_id, exc)
                return False
            session.data_out = conn
            self.outs[conn.fd] = conn
            conn.enqueue(dataframe.preface(session.token), None)
        conn.enqueue(parts, owner)
        return not conn.closed

    def cancel(self, ot: OutTransfer) -> None:
        """Drop the queued frames of a transfer that ended (not ACKed)."""
        session = ot.session
        if session is not None and session.data_out is not None:
            session.data_out.cancel(ot)

    def close_session(self, session: Session) -> None:
        """The session ended: close its connections both ways."""
        if session.data_out is not None:
            session.data_out.close("session dropped")
        for conn in [c for c in self.ins.values() if c.session is session]:
            conn.close("session dropped")

    def tick(self, now: float) -> None:
        """Close data connections that did not authenticate within the link timeout."""
        limit = self.core.config.link_timeout_s
        for conn in [c for c in self.ins.values() if c.session is None]:
            if now - conn.opened > limit:
                self.core.metrics.reject("data_unauthenticated")
                conn.close("no preface in time")

    def shutdown(self) -> None:
        """Close every socket (engine shutdown)."""
        for out in list(self.outs.values()):
            out.close("engine closed")
        for conn in list(self.ins.values()):
            conn.close("engine closed")
        self.core.poller.unregister(self.fd)
        self.listener.close()

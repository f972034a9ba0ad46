"""Our end of a data connection: queue frames, write what the kernel takes, hash behind it.

One :class:`DataOut` per session, opened lazily by the channel
(:mod:`transfer.transports.tcp.channel`)::

    resolving (a host name, on a helper thread) ──> connecting (non-blocking) ──> established
         │                                              │
         └──── never established in time: the channel marks the data address unusable,
               stream transfers go over the ZMQ link instead

Frames wait in one queue until the kernel takes them; a frame's source views count as in
flight (``FrameOwner.queued``) until every byte went, like ZMQ's zero-copy frames. A trailer
frame's body is hashed a piece at a time right after the kernel took it (``Pending``).
"""

from __future__ import annotations

import errno
import itertools
import logging
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import zmq

from transfer import checksum
from transfer.addresses import is_ip, split_host_port
from transfer.config import TransferConfig
from transfer.loop import IOLoop
from transfer.outbox import FrameOwner, Part
from transfer.session import Session
from transfer.transports.tcp import frames

log = logging.getLogger(__name__)
#: Buffers handed to one ``sendmsg``.
IOV_LIMIT = 64
#: A trailer frame's body is offered to the kernel at most this far past what was hashed,
#: and each piece the kernel took is hashed right after, while the kernel's copy left it in
#: the cache. Hashing ahead instead read the source from memory first: the sender hashed at
#: ~6.5 GB/s that way, ~10 GB/s behind (bench transfer's layout, development machine).
#: Pieces as large as the L2 cache cost more (the kernel's copy evicts half of them), much
#: smaller ones more system calls (256 KiB on a 1 MiB L2: 0.38 of a push against 0.27).
HASH_PIECE = frames.HASH_PIECE


class Channel(Protocol):
    """What a :class:`DataOut` needs of its channel
    (:class:`~transfer.transports.tcp.channel.DataChannel`)."""

    config: TransferConfig
    loop: IOLoop
    outs: dict[int, DataOut]

    def resolve(self, conn: DataOut) -> None: ...
    def unusable(self, session: Session, reason: str) -> None: ...
    def peer_closed(self, session: Session) -> None: ...
    def guarded(self, conn: DataOut, handler: Callable[[int], None]) -> Callable[[int], None]: ...


@dataclass(slots=True, eq=False)
class Pending:
    """One queued frame; ``owner`` holds source views until the kernel took every byte."""

    parts: list[memoryview]
    owner: FrameOwner | None
    size: int
    #: Trailer frames ``[header, body, trailer]``: the body's checksum, fed a piece at a time
    #: just after the kernel took it; ``hashed``: bytes of the body fed so far.
    hash_with: checksum.Running | None = None
    hashed: int = 0
    sealed: bool = True  # the trailer holds the body's digest (always, without one)

    def sendable(self) -> int:
        """How many bytes of the frame may be written now: the body up to ``HASH_PIECE``
        past what was hashed, the trailer only once it holds the digest of all of it."""
        if self.sealed:
            return self.size
        head, body, _ = self.parts
        return head.nbytes + min(body.nbytes, self.hashed + HASH_PIECE)

    def hash_written(self, written: int) -> None:
        """Hash the body bytes among the first ``written`` bytes of the frame not hashed yet;
        once all of it is, the digest goes into the trailer."""
        if self.sealed:
            return
        assert self.hash_with is not None
        head, body, tail = self.parts
        upto = min(max(written - head.nbytes, 0), body.nbytes)
        if upto > self.hashed:
            self.hash_with.update(body[self.hashed : upto])
            self.hashed = upto
        if upto == body.nbytes:
            tail[:] = frames.trailer(self.hash_with.value())
            self.sealed = True


def socket_for(host: str) -> socket.socket:
    """A non-blocking TCP socket for ``host``'s address family, Nagle off."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(False)
    return sock


class DataOut:
    """Our connection to a peer's data listener (sending side of one session).

    ``resolving`` (a host name, looked up on a helper thread) -> ``connecting`` (waiting for
    the non-blocking connect) -> ``established``. Frames queue meanwhile. If it is never
    established (bad name, refused, unreachable, no answer within ``link_timeout_s``), the
    channel marks the session's data address unusable and stream transfers use the link.
    """

    def __init__(self, chan: Channel, session: Session) -> None:
        self.chan, self.session = chan, session
        self.host, self.port = split_host_port(session.data_address, "data address")
        self.sock: socket.socket | None = None
        self.fd = -1
        self.queue: deque[Pending] = deque()
        self.offset = 0  # bytes of queue[0] already written
        self.flags = 0
        self.closed = False
        self.established = False
        self.deadline = time.monotonic() + chan.config.link_timeout_s
        if is_ip(self.host):
            self.connect(self.host)
        else:
            chan.resolve(self)

    def connect(self, ip: str) -> None:
        """Start the non-blocking connect to ``ip``."""
        if self.closed:
            return
        self.sock = socket_for(ip)
        err = self.sock.connect_ex((ip, self.port))
        self.fd = self.sock.fileno()
        self.chan.outs[self.fd] = self
        if err not in (0, errno.EINPROGRESS):
            self.fail(f"connect: {errno.errorcode.get(err, err)}")
            return
        self._want(zmq.POLLOUT)  # writable once connected (or failed)

    def fail(self, reason: str) -> None:
        """Never established: this data address is unusable for the session."""
        self.close(f"could not connect: {reason}")
        self.chan.unusable(self.session, f"{self.session.data_address}: {reason}")

    def enqueue(
        self,
        parts: Sequence[Part],
        owner: FrameOwner | None,
        hash_with: checksum.Running | None = None,
    ) -> None:
        """Queue one frame and write what the kernel takes now (dropped once closed).
        ``hash_with``: ``parts`` is ``[header, body, trailer]`` and the trailer is the body's
        digest, computed as the body is written."""
        if self.closed:
            return
        views = [memoryview(p).cast("B") for p in parts]
        size = sum(v.nbytes for v in views)
        frame = Pending(views, owner, size, hash_with, sealed=hash_with is None)
        frame.hash_written(0)  # an empty body is sealed at once
        self.queue.append(frame)
        if owner is not None:
            owner.queued += size
        self.flush()

    def flush(self) -> None:
        """Write queued frames until the kernel would block; close on a socket error."""
        if not self.established or self.sock is None:
            return
        while self.queue and not self.closed:
            bufs: list[memoryview] = []
            written = self.offset  # of the first frame; later frames start at 0
            for frame in itertools.islice(self.queue, IOV_LIMIT // 3):
                limit = frame.sendable()
                start = 0
                for part in frame.parts:
                    end = start + part.nbytes
                    lo, hi = max(written, start), min(limit, end)
                    if lo < hi:
                        bufs.append(
                            part if (lo, hi) == (start, end) else part[lo - start : hi - start]
                        )
                    start = end
                if limit < frame.size:
                    break  # the rest of it waits for the hash of what goes now
                written = 0
            try:
                n = self.sock.sendmsg(bufs)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self.close(f"send failed: {exc}")
                self.chan.peer_closed(self.session)
                return
            self.offset += n
            while self.queue:
                self.queue[0].hash_written(self.offset)
                if self.offset < self.queue[0].size:
                    break
                frame = self.queue.popleft()
                self.offset -= frame.size
                if frame.owner is not None:
                    frame.owner.queued -= frame.size
        self._want(zmq.POLLIN | (zmq.POLLOUT if self.queue else 0))

    def cancel(self, owner: FrameOwner) -> None:
        """Forget ``owner``'s queued frames (closing the connection if one is half written)."""
        if self.queue and self.offset and self.queue[0].owner is owner:
            self.close("a cancelled transfer's frame was half written")
            return
        self.queue = deque(f for f in self.queue if f.owner is not owner)
        owner.queued = 0

    def on_event(self, events: int) -> None:
        assert self.sock is not None
        if not self.established:
            err = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err:
                self.fail(errno.errorcode.get(err, str(err)))
                return
            if not events & zmq.POLLOUT:
                return
            self.established = True
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
            self.chan.peer_closed(self.session)

    def _want(self, flags: int) -> None:
        if flags != self.flags and not self.closed:
            self.chan.loop.watch(self.fd, flags, self.chan.guarded(self, self.on_event))
            self.flags = flags

    def close(self, reason: str) -> None:
        """Close the socket; queued frames are dropped (their chunks will be NACKed/resent)."""
        if self.closed:
            return
        self.closed = True
        log.debug("data channel to %s closed: %s", self.session.peer_id, reason)
        if self.flags:
            self.chan.loop.unwatch(self.fd)
        self.chan.outs.pop(self.fd, None)
        if self.sock is not None:
            self.sock.close()
        for frame in self.queue:
            if frame.owner is not None:
                frame.owner.queued -= frame.size
        self.queue.clear()
        if self.session.data_out is self:
            self.session.data_out = None

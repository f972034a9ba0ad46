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

import concurrent.futures
import contextlib
import errno
import itertools
import logging
import socket
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from transfer import auth, checksum, dataframe
from transfer.addresses import is_ip, join_host_port, split_host_port
from transfer.config import TransferConfig
from transfer.errors import TransferError
from transfer.intake import DataIn
from transfer.loop import IOLoop
from transfer.metrics import Metrics
from transfer.outbox import FrameOwner, Part
from transfer.session import Session

log = logging.getLogger(__name__)
#: Unauthenticated data connections kept at once (oldest closed first).
MAX_UNAUTHENTICATED = 64
#: Buffers handed to one ``sendmsg``.
IOV_LIMIT = 64
#: A trailer frame's body is offered to the kernel at most this far past what was hashed,
#: and each piece the kernel took is hashed right after, while the kernel's copy left it in
#: the cache. Hashing ahead instead read the source from memory first: the sender hashed at
#: ~6.5 GB/s that way, ~10 GB/s behind (bench transfer's layout, development machine).
#: Smaller pieces cost more in system calls than they save (256 KiB: +20% per push).
HASH_PIECE = 1 << 20


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
            tail[:] = dataframe.trailer(self.hash_with.value())
            self.sealed = True


def _socket_for(host: str) -> socket.socket:
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

    def __init__(self, chan: DataChannel, session: Session) -> None:
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
        self.sock = _socket_for(ip)
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


class DataChannel:
    """The data listener of one engine and all its data connections (I/O thread only)."""

    def __init__(
        self,
        config: TransferConfig,
        loop: IOLoop,
        metrics: Metrics,
        engine_id: str,
        accept: Callable[[socket.socket, Callable[[DataIn], None]], DataIn],
    ) -> None:
        self.config, self.loop, self.metrics, self.engine_id = config, loop, metrics, engine_id
        self._new_intake = accept
        self.listener = _socket_for(config.host)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((config.host, config.data_port))
        self.listener.listen(64)
        port = self.listener.getsockname()[1]
        self.address = join_host_port(config.advertise_host or config.host, port)
        self.fd = self.listener.fileno()
        loop.watch(self.fd, zmq.POLLIN, lambda events: self._accept())
        self.ins: dict[int, DataIn] = {}
        self.outs: dict[int, DataOut] = {}
        #: Outgoing connections not established yet (checked against their deadline).
        self.connecting: list[DataOut] = []
        #: Told when a session's data address proves unusable (the sender falls back).
        self.on_unusable: Callable[[Session], None] | None = None
        #: Told when a peer closes our data connection (is the session still known there?).
        self.on_peer_closed: Callable[[Session], None] | None = None
        self._resolver: concurrent.futures.ThreadPoolExecutor | None = None

    def guarded(
        self, conn: DataIn | DataOut, handler: Callable[[int], None]
    ) -> Callable[[int], None]:
        """``handler`` for one connection's events: a failure there closes that connection
        only (and is counted), never the I/O thread."""

        def run(events: int) -> None:
            try:
                handler(events)
            except Exception:
                log.exception("engine %s: data connection failed", self.engine_id)
                self.metrics.internal_errors_total += 1
                self.metrics.reject("internal_error")
                conn.close("internal error")

        return run

    def _accept(self) -> None:
        for _ in range(16):
            try:
                sock, _addr = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and friends: keep serving what we have
                log.warning("engine %s: data accept failed: %s", self.engine_id, exc)
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = self._new_intake(sock, self._closed_in)
            self.ins[conn.fd] = conn
            self.loop.watch(conn.fd, zmq.POLLIN, self.guarded(conn, _reader(conn)))
            waiting = [c for c in self.ins.values() if c.session is None]
            for stale in waiting[: max(0, len(waiting) - MAX_UNAUTHENTICATED)]:
                self.metrics.reject("data_unauthenticated")
                stale.close("too many unauthenticated data connections")

    def _closed_in(self, conn: DataIn) -> None:
        self.loop.unwatch(conn.fd)
        self.ins.pop(conn.fd, None)

    def send(
        self,
        session: Session,
        parts: list[Part],
        owner: FrameOwner | None,
        hash_with: checksum.Running | None = None,
    ) -> bool:
        """Queue one frame to ``session``'s peer, connecting first if needed."""
        if session.data_failed:
            return False
        conn = session.data_out
        if conn is None or conn.closed:
            try:
                conn = DataOut(self, session)
            except (OSError, TransferError) as exc:
                self.unusable(session, str(exc))
                return False
            if conn.closed:
                return False
            session.data_out = conn
            self.connecting.append(conn)
            proof = auth.data_proof(session.token, session.peer_id)
            conn.enqueue(dataframe.preface(proof), None)
        conn.enqueue(parts, owner, hash_with)
        return not conn.closed

    def resolve(self, conn: DataOut) -> None:
        """Look ``conn``'s host name up on a helper thread, then connect (I/O thread)."""
        if self._resolver is None:
            self._resolver = concurrent.futures.ThreadPoolExecutor(1, "resolve")
        fut = self._resolver.submit(socket.getaddrinfo, conn.host, conn.port, 0, socket.SOCK_STREAM)

        def done(f: concurrent.futures.Future[Any]) -> None:
            with contextlib.suppress(TransferError):  # the engine closed meanwhile
                self.loop.call(lambda: self._resolved(conn, f))

        fut.add_done_callback(done)

    def _resolved(self, conn: DataOut, fut: concurrent.futures.Future[Any]) -> None:
        try:
            infos = fut.result()
        except OSError as exc:
            conn.fail(f"cannot resolve {conn.host!r}: {exc}")
            return
        if not infos:
            conn.fail(f"no address for {conn.host!r}")
            return
        conn.connect(str(infos[0][4][0]))

    def peer_closed(self, session: Session) -> None:
        """The peer closed an established data connection (it may have restarted)."""
        if self.on_peer_closed is not None:
            self.on_peer_closed(session)

    def unusable(self, session: Session, reason: str) -> None:
        """``session``'s data address cannot be connected: streams fall back to the link."""
        if session.data_failed:
            return
        session.data_failed = True
        self.metrics.data_fallbacks_total += 1
        log.warning(
            "engine %s: data channel to %s unusable (%s); streaming over the link",
            self.engine_id,
            session.peer_id,
            reason,
        )
        if self.on_unusable is not None:  # after this step: the sender may be mid-attempt
            callback = self.on_unusable
            self.loop.at(0.0, lambda: callback(session))

    def cancel(self, out: FrameOwner) -> None:
        """Drop the queued frames of a transfer that ended (not ACKed)."""
        session = out.session
        if session is not None and session.data_out is not None:
            session.data_out.cancel(out)

    def close_session(self, session: Session) -> None:
        """The session ended: close its connections both ways."""
        if session.data_out is not None:
            session.data_out.close("session dropped")
        for conn in [c for c in self.ins.values() if c.session is session]:
            conn.close("session dropped")

    def tick(self, now: float) -> None:
        """Give up on connections not established in time; close data connections that did
        not authenticate within the link timeout."""
        for out in list(self.connecting):
            if out.established or out.closed:
                self.connecting.remove(out)
            elif now > out.deadline:
                self.connecting.remove(out)
                out.fail("no connection within the link timeout")
        limit = self.config.link_timeout_s
        for conn in [c for c in self.ins.values() if c.session is None]:
            if now - conn.opened > limit:
                self.metrics.reject("data_unauthenticated")
                conn.close("no preface in time")

    def shutdown(self) -> None:
        """Close every socket (engine shutdown)."""
        for out in list(self.outs.values()):
            out.close("engine closed")
        for conn in list(self.ins.values()):
            conn.close("engine closed")
        self.loop.unwatch(self.fd)
        self.listener.close()
        if self._resolver is not None:
            self._resolver.shutdown(wait=False, cancel_futures=True)


def _reader(conn: DataIn) -> Callable[[int], None]:
    def read(events: int) -> None:
        conn.on_readable()

    return read

"""The data channel: a plain TCP socket per session beside the ZMQ link, for stream transfers.

ZMQ always receives into its own buffers, so the ZMQ stream costs the receiver one more full
copy than the network itself. On the data channel the receiver reads each chunk with
``recv_into`` straight into the destination blocks (:mod:`transfer.transports.tcp.data_in`)::

    sender (I/O thread)                                  receiver (I/O thread)
      connect(peer's advertised data address)  ──>  accept; nothing is read but a PREFACE
      PREFACE {session token}                  ──>  token of a live session? else close, count
      MESSAGE BEGIN {stream=n, msgpack begin}  ──>  validate, reserve check (as over ZMQ)
      DATA {n, seq, ti, lo, hi, len, digest} + bytes ─> epoch check; recv_into dst blocks
      MESSAGE END                              ──>  all chunks verified? commit
                                   <── ACK / ERROR over the ZMQ link, as before

BEGIN and END travel in band so the receiver always sees them in order with the chunks.
Both engines advertise ``host:port`` of their data listener in the handshake. Everything is
non-blocking on the I/O thread; frames wait in a bounded per-transfer queue of our end of
the connection (:mod:`transfer.transports.tcp.data_out`) until the kernel takes them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import socket
from collections.abc import Callable
from typing import Any

import zmq

from transfer import auth, checksum
from transfer.addresses import join_host_port
from transfer.config import TransferConfig
from transfer.errors import TransferError
from transfer.loop import IOLoop
from transfer.metrics import Metrics
from transfer.outbox import FrameOwner, Part
from transfer.session import Session
from transfer.transports.tcp import frames
from transfer.transports.tcp.data_in import DataIn
from transfer.transports.tcp.data_out import DataOut, socket_for

log = logging.getLogger(__name__)
#: Unauthenticated data connections kept at once (oldest closed first).
MAX_UNAUTHENTICATED = 64


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
        self.listener = socket_for(config.host)
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
            conn.enqueue(frames.preface(proof), None)
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

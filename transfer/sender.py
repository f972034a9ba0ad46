"""Sending side: the per-transfer state machine for pushes (and for pulls we serve).

Phases of one attempt (see the handle diagram in :mod:`transfer.handle`)::

    link ──> choose a transport, plan_attempt ──> BEGIN
         ──> [direct] grant ──> direct (transports.direct.pump_direct) ──> ack ──> DONE
         └─> [stream] send (transports.tcp.stream.pump_stream) ───────> ack ──┘
    any phase: deadline -> TIMED_OUT; lease -> TIMED_OUT (LEASE_EXPIRED);
    no answer by attempt_until / recoverable error -> backoff -> (re-link) -> link ...

The source blocks stay held until the ACK, a non-recoverable error, the deadline or the
lease, and until ZMQ released every zero-copy frame that still points into them. The
sender learns about sessions from the linker's events (``on_linked``, ``on_lost``,
``on_link_failed``) and asks it for sessions and re-links; it never touches the tables.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque

from transfer import aead, transports, wire
from transfer.config import TransferConfig
from transfer.errors import StatusCode, TransferError
from transfer.faults import FaultInjector
from transfer.handle import TransferHandle, TransferState
from transfer.hashing import Hasher
from transfer.linker import Linker
from transfer.loop import IOLoop
from transfer.messages import Ack, End, Error, Grant
from transfer.metrics import Metrics, TransportMetrics
from transfer.outbox import Outbox
from transfer.outgoing import OutTransfer, Phase, plan_attempt
from transfer.session import Identity, Session
from transfer.transports import direct
from transfer.transports.tcp.stream import WINDOW_BYTES, pump_stream, send_framing

log = logging.getLogger(__name__)

#: Slowest rate (bytes/s) assumed when sizing the wait for an ACK.
MIN_RATE = 100e6
#: Safety margin kept before a direct-write grant ends.
GRANT_MARGIN_S = 0.25
#: How often deadlines are checked (seconds).
CHECK_EVERY_S = 0.005


class Sender:
    """All outgoing transfers of one engine (I/O thread only)."""

    def __init__(
        self,
        me: Identity,
        config: TransferConfig,
        loop: IOLoop,
        outbox: Outbox,
        links: Linker,
        metrics: Metrics,
        hasher: Hasher,
        injector: FaultInjector | None,
    ) -> None:
        self.me, self.config, self.loop, self.outbox, self.links = me, config, loop, outbox, links
        self.metrics, self.hasher, self.injector = metrics, hasher, injector
        self.active: dict[str, OutTransfer] = {}
        self._next_check = 0.0
        self._streams = itertools.count(1)
        links.on_linked.append(self.on_linked)
        links.on_lost.append(self.on_session_lost)
        links.on_link_failed.append(self.on_link_failed)

    def _counters(self, out: OutTransfer) -> TransportMetrics:
        return self.metrics.of(out.transport or "tcp")

    # ---- starting -----------------------------------------------------------------------
    def start(self, out: OutTransfer) -> None:
        """Begin a transfer created by ``push_blocks`` or by a peer's pull."""
        transfer_id = out.handle.transfer_id
        if transfer_id in self.active:
            err = TransferError(
                StatusCode.REPEAT_REQUEST, f"transfer id {transfer_id!r} is already in flight"
            )
            self.loop.finish(out.handle, TransferState.FAILED, err)
            return
        self.active[transfer_id] = out
        self._attempt(out)

    def _attempt(self, out: OutTransfer) -> None:
        now, peer = time.monotonic(), out.handle.peer
        session = self.links.session_for(peer)
        if session is None:
            address = self.links.addresses.get(peer)
            if address is None:
                why = f"no link to {peer!r}; call link() or set_peer_address() first"
                self._fail(out, TransferError(StatusCode.NOT_LINKED, why))
                return
            out.phase, out.attempt_until = Phase.LINK, now + self.config.link_timeout_s
            self.links.connect(peer, address)
            return
        description = session.regions.get(out.dst.region)
        if description is None:  # maybe registered after the link; its announcement is coming
            out.handle.attempts += 1
            why = f"peer {session.peer_id!r} has no region {out.dst.region!r}"
            self._retry(out, TransferError(StatusCode.KV_CACHE_NOT_EXIST, why))
            return
        try:
            out.transport = transports.choose(
                self.config.transports, out.forced, session, self.me.host, out.region, description
            )
        except ValueError as exc:
            self._fail(out, TransferError(StatusCode.PARAM_INVALID, str(exc)))
            return
        out.session = session
        out.handle.attempts += 1
        if out.handle.state is TransferState.PENDING:
            out.handle.state = TransferState.IN_FLIGHT
            self._counters(out).transfers_started_total += 1
        direct = out.transport in transports.DIRECT
        begin = plan_attempt(out, self.config, direct)
        out.via_data = out.transport == "tcp" and self.outbox.has_data_channel(session)
        if out.via_data:
            out.stream = out.stream or next(self._streams)
        out.begin = begin
        out.begin_digest = aead.begin_digest(begin)
        send_framing(self.outbox, out, begin)
        out.phase = Phase.GRANT if direct else Phase.SEND
        out.attempt_until = now + self.config.ack_timeout_s + out.handle.nbytes / MIN_RATE

    # ---- moving bytes -------------------------------------------------------------------
    def busy_hint(self) -> float | None:
        """0 if bytes can move now, a short nap if only the send window is full, else None."""
        hint = None
        for out in self.active.values():
            if out.queue and out.phase is Phase.DIRECT:
                return 0.0
            if out.queue and out.phase is Phase.SEND and not out.waiting_digest:
                if out.inflight < WINDOW_BYTES:
                    return 0.0
                hint = 0.001
        return hint

    def pump(self) -> None:
        """Move a bounded slice of every runnable transfer; check deadlines."""
        for out in list(self.active.values()):
            try:
                self._move(out)
            except TransferError as err:  # e.g. KV the wire codec cannot encode
                self._fail(out, err)
            except Exception as exc:  # a bug or a device error: fail this transfer only
                log.exception("transfer %s failed", out.handle.transfer_id)
                oom = "out of memory" in str(exc)
                code = StatusCode.OUT_OF_MEMORY if oom else StatusCode.INTERNAL
                self._fail(out, TransferError(code, f"{type(exc).__name__}: {exc}"))
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + CHECK_EVERY_S
            for out in list(self.active.values()):
                self._check(out, now)

    def _move(self, out: OutTransfer) -> None:
        if out.phase is Phase.SEND and pump_stream(
            out, self.outbox, self._counters(out), self.hasher
        ):
            self._send_end(out, None)
        elif out.phase is Phase.DIRECT:
            if time.monotonic() > out.grant_until:
                self._retry(out, TransferError(StatusCode.TIMEOUT, "direct-write grant ran out"))
                return
            digests = direct.pump_direct(
                out,
                self.injector,
                self._counters(out),
                self.links.drop,
                lambda seqs: self._send_landed(out, seqs),
                self.hasher.run,
            )
            if digests is not None:
                self._send_end(out, digests or None)

    def _send_landed(self, out: OutTransfer, seqs: list[int]) -> None:
        """Tell a direct write's receiver which chunks are in place (LANDED)."""
        assert out.session is not None
        for landed in direct.landed_reports(out, seqs):
            self.outbox.post(out.session, landed)

    def _send_end(self, out: OutTransfer, digests: list[int] | None) -> None:
        assert out.session is not None
        end = End(transfer_id=out.handle.transfer_id, num_chunks=len(out.chunks), digests=digests)
        send_framing(self.outbox, out, end)
        out.phase = Phase.ACK
        out.attempt_until = time.monotonic() + self.config.ack_timeout_s

    # ---- answers ------------------------------------------------------------------------
    def on_reply(self, session: Session, msg: Grant | Ack | Error) -> None:
        """GRANT, ACK or ERROR about one of our transfers."""
        out = self.active.get(msg.transfer_id)
        if out is None or out.closing is not None or session.peer_id != out.handle.peer:
            return  # late answer to a finished transfer
        if isinstance(msg, Grant):
            self._on_grant(out, session, msg)
            return
        code = msg.status
        if code is StatusCode.SUCCESS:
            if isinstance(msg, Ack) and msg.duplicate:
                self._counters(out).duplicates_total += 1
            self._close(out, TransferState.DONE, None, "ack")
            return
        err = TransferError(code, f"peer {session.peer_id!r}: {msg.text}")
        bad = msg.bad if isinstance(msg, Ack) else []
        if code is StatusCode.CHECKSUM_MISMATCH:
            self._counters(out).checksum_failures_total += 1
        if bad and code.recoverable and out.transport == "tcp":
            self._resend(out, bad, err)
        elif code.recoverable:
            self._retry(out, err)
        else:
            self._fail(out, err)

    def _on_grant(self, out: OutTransfer, session: Session, msg: Grant) -> None:
        if out.phase is not Phase.GRANT or out.transport not in transports.DIRECT:
            return
        description = session.regions.get(out.dst.region)
        try:
            if description is None:
                why = f"cannot open peer region: {out.dst.region!r}"
                raise TransferError(StatusCode.KV_CACHE_NOT_EXIST, why)
            out.dst_tensors = transports.open_destination(out.transport, session, description)
        except TransferError as err:
            self._fail(out, err)
            return
        out.dst_layout = description.layout
        # The receiver's own deadline (same host, same monotonic clock), bounded by the
        # window's length counted from now in case the clocks disagree after all.
        now = time.monotonic()
        until = min(msg.until, now + msg.ttl) - GRANT_MARGIN_S
        if until <= now:
            self._retry(out, TransferError(StatusCode.TIMEOUT, "grant arrived too late"))
            return
        out.grant_until, out.phase, out.grant = until, Phase.DIRECT, msg.grant

    def _resend(self, out: OutTransfer, bad: list[int], err: TransferError) -> None:
        """The receiver NACKed some chunks of a stream: send just those again."""
        if any(seq >= len(out.chunks) for seq in bad):
            raise wire.FrameError("bad_field", "ack.bad names chunks we never planned")
        self._counters(out).retries_total += 1
        if out.handle.attempts >= self.config.retry.attempts:
            self._fail(out, err)
            return
        out.handle.attempts += 1
        out.queue = deque(bad)
        out.prepared.clear()
        if out.via_data and out.begin is not None:  # the data connection may be new:
            send_framing(self.outbox, out, out.begin)  # name the stream again
        out.phase = Phase.SEND
        out.attempt_until = time.monotonic() + self.config.ack_timeout_s

    def _retry(self, out: OutTransfer, err: TransferError) -> None:
        """Back off, re-link when the link looks dead, then start a new attempt."""
        if out.handle.attempts >= self.config.retry.attempts:
            self._fail(out, err)
            return
        self._counters(out).retries_total += 1
        relink = err.code in (StatusCode.TIMEOUT, StatusCode.NOT_LINKED)
        session = out.session
        if relink and session is not None and session.alive and session.outbound:
            self._counters(out).relinks_total += 1
            self.links.relink(session)
        out.phase, out.session, out.dst_tensors, out.last_error = Phase.BACKOFF, None, None, err
        out.retry_at = time.monotonic() + self.config.retry.delay(out.handle.attempts)

    def _check(self, out: OutTransfer, now: float) -> None:
        if out.closing is not None:
            if out.inflight == 0:
                self._release(out)
            return
        if now > out.lease_until:
            self._counters(out).lease_expiries_total += 1
            why = "no ACK before the lease on the source blocks expired"
            err = TransferError(StatusCode.LEASE_EXPIRED, why)
            self._close(out, TransferState.TIMED_OUT, err, "lease_expired")
        elif now > out.deadline:
            last = f"; last error: {out.last_error.message}" if out.last_error else ""
            why = f"not acknowledged within its deadline (phase {out.phase.value}){last}"
            self._close(
                out, TransferState.TIMED_OUT, TransferError(StatusCode.TIMEOUT, why), "timeout"
            )
        elif out.phase is Phase.BACKOFF and now >= out.retry_at:
            self._attempt(out)
        elif out.phase is not Phase.BACKOFF and now > out.attempt_until:
            self._retry(
                out, TransferError(StatusCode.TIMEOUT, f"no answer in phase {out.phase.value}")
            )

    # ---- leases -------------------------------------------------------------------------
    def renew(self, request_id: str, now: float, seconds: float | None = None) -> int:
        """Extend the source-block leases of our pushes for ``request_id``; how many."""
        count = 0
        for out in self.active.values():
            if out.handle.request_id == request_id and out.closing is None:
                out.lease_until = max(out.lease_until, now + (seconds or out.lease_s))
                count += 1
        return count

    def extend_lease(self, transfer_id: str, until: float) -> None:
        """Move one transfer's lease (and deadline) to ``until`` (a renewed offer's)."""
        out = self.active.get(transfer_id)
        if out is not None and out.closing is None:
            out.lease_until = max(out.lease_until, until)
            out.deadline = max(out.deadline, until)

    # ---- link events --------------------------------------------------------------------
    def on_linked(self, session: Session) -> None:
        """A (re-)link completed: resume transfers waiting for it."""
        for out in list(self.active.values()):
            if (
                out.phase is Phase.LINK
                and out.handle.peer == session.peer_id
                and out.closing is None
            ):
                self._attempt(out)

    def on_link_failed(self, peer: str, err: TransferError) -> None:
        """A handshake failed: transfers waiting for it retry (or fail if non-recoverable)."""
        for out in list(self.active.values()):
            if out.phase is Phase.LINK and out.handle.peer == peer and out.closing is None:
                (self._retry if err.recoverable else self._fail)(out, err)

    def on_data_unusable(self, session: Session) -> None:
        """The peer's data channel cannot be reached: stream transfers on it go over the
        link instead, now rather than after their attempt times out."""
        err = TransferError(StatusCode.LINK_FAILED, "data channel unreachable: using the link")
        for out in list(self.active.values()):
            if out.session is session and out.via_data and out.closing is None:
                self._retry(out, err)

    def on_session_lost(self, session: Session, reason: str) -> None:
        """Transfers on a dropped session wait for a new link until their attempt times out."""
        for out in self.active.values():
            if out.session is session and out.closing is None:
                out.session, out.phase = None, Phase.LINK

    # ---- ending -------------------------------------------------------------------------
    def _fail(self, out: OutTransfer, err: TransferError) -> None:
        cancelled = err.code is StatusCode.CANCELLED
        state = TransferState.CANCELLED if cancelled else TransferState.FAILED
        self._close(out, state, err, "cancelled" if cancelled else "failed")

    def _close(
        self, out: OutTransfer, state: TransferState, err: TransferError | None, released: str
    ) -> None:
        counters = self._counters(out)
        if state is TransferState.DONE:
            counters.transfers_done_total += 1
            counters.observe(out.handle.nbytes, time.monotonic() - out.handle.created)
        elif state is TransferState.TIMED_OUT:
            counters.transfers_timed_out_total += 1
        else:
            counters.transfers_failed_total += 1
        out.closing, out.phase = (state, err, released), Phase.CLOSING
        out.queue.clear()
        out.prepared.clear()
        if out.queued:
            self.outbox.cancel_queued(out)
        session = out.session
        if (
            out.inflight
            and session is not None
            and session.outbound
            and state is not TransferState.DONE
        ):
            self.links.relink(session)  # discard queued zero-copy frames
        if out.inflight == 0:
            self._release(out)

    def _release(self, out: OutTransfer) -> None:
        assert out.closing is not None
        self.active.pop(out.handle.transfer_id, None)
        self.loop.finish(out.handle, *out.closing)
        if out.on_closed is not None:
            out.on_closed(out.closing[0], out.closing[1])

    def cancel(self, handle: TransferHandle) -> None:
        """Caller-requested cancel."""
        out = self.active.get(handle.transfer_id)
        if out is not None and out.closing is None:
            self._fail(out, TransferError(StatusCode.CANCELLED, "cancelled by the caller"))

    def abort_all(self, err: TransferError) -> None:
        """Engine shutdown."""
        for out in list(self.active.values()):
            self.loop.finish(out.handle, TransferState.FAILED, err, "failed")
        self.active.clear()

    def held_ids(self) -> dict[str, set[int]]:
        """Source blocks held by unfinished transfers, per region (for leak checks)."""
        held: dict[str, set[int]] = {}
        for out in list(self.active.values()):  # also read from caller threads
            held.setdefault(out.region.name, set()).update(out.src_ids.tolist())
        return held

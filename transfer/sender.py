"""Sending side: the per-transfer state machine for pushes (and for pulls we serve).

Phases of one attempt (see the handle diagram in :mod:`transfer.handle`)::

    link ──> [direct] grant ──> direct (copy chunks) ──> ack ──> DONE
         └─> [stream] send (chunks) ───────────────────> ack ──┘
    any phase: deadline -> TIMED_OUT; lease -> TIMED_OUT (LEASE_EXPIRED);
    no answer by attempt_until / recoverable error -> backoff -> (re-link) -> link ...

The source blocks stay held until the ACK, a non-recoverable error, the deadline or the
lease, and until ZMQ released every zero-copy frame that still points into them.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any

from transfer import checksum, dataframe, layout, movers, transports, wire
from transfer.errors import StatusCode, TransferError
from transfer.handle import TransferHandle, TransferState
from transfer.movers import WINDOW_BYTES, OutTransfer
from transfer.region import dtype_name
from transfer.session import Session

if TYPE_CHECKING:
    from transfer.core import Core

log = logging.getLogger(__name__)

#: Slowest rate (bytes/s) assumed when sizing the wait for an ACK.
MIN_RATE = 100e6
#: Safety margin kept before a direct-write grant ends.
GRANT_MARGIN_S = 0.25


class Sender:
    """All outgoing transfers of one engine (I/O thread only)."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.active: dict[str, OutTransfer] = {}
        self._next_check = 0.0
        self._streams = itertools.count(1)

    # ---- starting -----------------------------------------------------------------------
    def start(self, ot: OutTransfer) -> None:
        """Begin a transfer created by ``push_blocks`` or by a peer's pull."""
        xid = ot.handle.transfer_id
        if xid in self.active:
            self.core.finish(
                ot.handle,
                TransferState.FAILED,
                TransferError(
                    StatusCode.REPEAT_REQUEST, f"transfer id {xid!r} is already in flight"
                ),
            )
            return
        self.active[xid] = ot
        self._attempt(ot)

    def _attempt(self, ot: OutTransfer) -> None:
        core, now = self.core, time.monotonic()
        session = core.session_for(ot.handle.peer)
        if session is None:
            address = core.linker.addresses.get(ot.handle.peer)
            if address is None:
                self._fail(
                    ot,
                    TransferError(
                        StatusCode.NOT_LINKED, f"no link to {ot.handle.peer!r}; call link() first"
                    ),
                )
                return
            ot.phase, ot.attempt_until = "link", now + core.config.link_timeout_s
            core.linker.connect(ot.handle.peer, address, None)
            return
        desc = session.regions.get(ot.dst.region)
        if desc is None:  # maybe registered after the link and its announcement is in flight
            ot.handle.attempts += 1
            self._retry(
                ot,
                TransferError(
                    StatusCode.KV_CACHE_NOT_EXIST,
                    f"peer {session.peer_id!r} has no region {ot.dst.region!r}",
                ),
            )
            return
        try:
            ot.transport = transports.choose(
                core.config.transports, ot.forced, session, core.host, ot.region, desc
            )
        except ValueError as exc:
            self._fail(ot, TransferError(StatusCode.PARAM_INVALID, str(exc)))
            return
        ot.session = session
        ot.handle.attempts += 1
        if ot.handle.state is TransferState.PENDING:
            ot.handle.state = TransferState.IN_FLIGHT
            core.metrics.of(ot.transport).transfers_started_total += 1
        direct = ot.transport in transports.DIRECT
        ot.algo = self._algo(ot, direct)
        n = ot.src_ids.numel()
        tensors = ot.region.tensor_range(ot.layers)
        # direct copies are chunked too: the grant window is checked before every chunk
        ot.bpc = layout.blocks_per_chunk(ot.region.block_bytes, core.config.chunk_bytes, n)
        ot.chunks = layout.plan(tensors, n, ot.bpc)
        ot.queue = deque(range(len(ot.chunks)))
        header = wire.encode(
            "begin",
            session.token,
            x=ot.handle.transfer_id,
            rid=ot.dst.request_id,
            ep=ot.dst.epoch,
            reg=ot.dst.region,
            dst=list(ot.dst.block_ids),
            nsrc=n,
            dt=dtype_name(ot.region.dtype),
            bs=ot.region.block_size,
            tpl=ot.region.tensors_per_layer,
            shape=list(ot.region.block_shape),
            lay=list(ot.layers),
            ntok=ot.num_tokens,
            nf=len(ot.chunks),
            bpc=ot.bpc,
            ck=ot.algo,
            mode=ot.transport,
        )
        ot.via_data = (
            ot.transport == "tcp"
            and core.datachan is not None
            and bool(session.data_address)
            and not session.data_failed
        )
        if ot.via_data:
            ot.stream = ot.stream or next(self._streams)
            ot.begin = header
            self._send_in_band(ot, "begin", header)
        else:
            core.send(session, "begin", header)
        ot.phase = "grant" if direct else "send"
        ot.attempt_until = now + core.config.ack_timeout_s + ot.handle.nbytes / MIN_RATE

    def _send_in_band(self, ot: OutTransfer, msg_type: str, header: bytes) -> None:
        """BEGIN / END on the data channel, in order with the chunks they frame."""
        if ot.session is None:
            return  # the session went away; the attempt timer decides
        frame = dataframe.message(ot.stream, header)
        self.core.send(ot.session, msg_type, frame, header, via_data=True)

    def _algo(self, ot: OutTransfer, direct: bool) -> str | None:
        cfg = self.core.config
        if ot.requested_algo == "off":
            return None
        if ot.requested_algo is not None:
            return checksum.resolve(ot.requested_algo)
        return checksum.resolve(cfg.checksum_algo) if cfg.checksums_on(direct) else None

    # ---- moving bytes -------------------------------------------------------------------
    def wait_hint(self) -> float | None:
        """0 if bytes can move now, a short nap if only ZMQ's queue is full, else None."""
        hint = None
        for ot in self.active.values():
            if ot.queue and ot.phase == "direct":
                return 0.0
            if ot.queue and ot.phase == "send":
                if ot.inflight < WINDOW_BYTES:
                    return 0.0
                hint = 0.001
        return hint

    def pump(self) -> None:
        """Move a bounded slice of every runnable transfer; check deadlines."""
        for ot in list(self.active.values()):
            try:
                if ot.phase == "send" and movers.pump_stream(self.core, ot):
                    self._send_end(ot, None)
                elif ot.phase == "direct":
                    if time.monotonic() > ot.grant_until:
                        self._retry(
                            ot, TransferError(StatusCode.TIMEOUT, "direct-write grant ran out")
                        )
                        continue
                    digests = movers.pump_direct(self.core, ot)
                    if digests is not None:
                        self._send_end(ot, digests or None)
            except Exception as exc:  # a bug or a device error: fail this transfer, not the engine
                log.exception("transfer %s failed", ot.handle.transfer_id)
                code = (
                    StatusCode.OUT_OF_MEMORY if "out of memory" in str(exc) else StatusCode.INTERNAL
                )
                self._fail(ot, TransferError(code, f"{type(exc).__name__}: {exc}"))
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + 0.005
            for ot in list(self.active.values()):
                self._check(ot, now)

    def _send_end(self, ot: OutTransfer, digests: list[int] | None) -> None:
        assert ot.session is not None
        header = wire.encode(
            "end", ot.session.token, x=ot.handle.transfer_id, nf=len(ot.chunks), ds=digests
        )
        if ot.via_data:
            self._send_in_band(ot, "end", header)
        else:
            self.core.send(ot.session, "end", header)
        ot.phase = "ack"
        ot.attempt_until = time.monotonic() + self.core.config.ack_timeout_s

    # ---- answers ------------------------------------------------------------------------
    def on_reply(self, session: Session, msg_type: str, h: dict[str, Any]) -> None:
        """GRANT, ACK or ERROR about one of our transfers."""
        ot = self.active.get(h["x"])
        if ot is None or ot.closing is not None or session.peer_id != ot.handle.peer:
            return  # late answer to a finished transfer
        code = StatusCode.from_number(h["code"]) if "code" in h else StatusCode.SUCCESS
        if msg_type == "grant":
            if ot.phase != "grant" or ot.transport not in transports.DIRECT:
                return
            try:
                desc = session.regions[ot.dst.region]
                ot.dst_tensors = transports.open_destination(ot.transport, session, desc)
            except (TransferError, OSError, KeyError) as exc:
                err = (
                    exc
                    if isinstance(exc, TransferError)
                    else TransferError(
                        StatusCode.KV_CACHE_NOT_EXIST, f"cannot open peer region: {exc}"
                    )
                )
                self._fail(ot, err)
                return
            # The receiver's own deadline (same host, same monotonic clock), bounded by the
            # window's length counted from now in case the clocks disagree after all.
            now = time.monotonic()
            until = min(float(h["until"]), now + float(h["ttl"])) - GRANT_MARGIN_S
            if until <= now:
                self._retry(ot, TransferError(StatusCode.TIMEOUT, "grant arrived too late"))
                return
            ot.grant_until, ot.phase = until, "direct"
            return
        if code is StatusCode.SUCCESS:
            if h.get("dup"):
                self.core.metrics.of(ot.transport).duplicates_total += 1
            self._close(ot, TransferState.DONE, None, "ack")
            return
        err = TransferError(code, f"peer {session.peer_id!r}: {h['msg']}")
        bad = h.get("bad") or []
        if code is StatusCode.CHECKSUM_MISMATCH:
            self.core.metrics.of(ot.transport or "tcp").checksum_failures_total += 1
        if msg_type == "ack" and code.recoverable and bad and ot.transport == "tcp":
            if not self._count_retry(ot, err):
                return
            ot.queue = deque(s for s in wire.int_list(bad, "bad", len(ot.chunks)))
            if ot.via_data:  # the data connection may be new: name the stream again
                self._send_in_band(ot, "begin", ot.begin)
            ot.phase = "send"
            ot.attempt_until = time.monotonic() + self.core.config.ack_timeout_s
            return
        if code.recoverable:
            self._retry(ot, err)
        else:
            self._fail(ot, err)

    def _count_retry(self, ot: OutTransfer, err: TransferError) -> bool:
        self.core.metrics.of(ot.transport or "tcp").retries_total += 1
        if ot.handle.attempts >= self.core.config.retry.attempts:
            self._fail(ot, err)
            return False
        ot.handle.attempts += 1
        return True

    def _retry(self, ot: OutTransfer, err: TransferError) -> None:
        """Back off, re-link when the link looks dead, then start a new attempt."""
        if ot.handle.attempts >= self.core.config.retry.attempts:
            self._fail(ot, err)
            return
        self.core.metrics.of(ot.transport or "tcp").retries_total += 1
        relink = err.code in (StatusCode.TIMEOUT, StatusCode.NOT_LINKED)
        if relink and ot.session is not None and ot.session.alive and ot.session.outbound:
            self.core.metrics.of(ot.transport or "tcp").relinks_total += 1
            self.core.linker.relink(ot.session)
        ot.phase, ot.session, ot.dst_tensors, ot.last_error = "backoff", None, None, err
        ot.retry_at = time.monotonic() + self.core.config.retry.delay(ot.handle.attempts)

    def _check(self, ot: OutTransfer, now: float) -> None:
        if ot.closing is not None:
            if ot.inflight == 0:
                self._release(ot)
            return
        if now > ot.lease_until:
            self.core.metrics.of(ot.transport or "tcp").lease_expiries_total += 1
            self._close(
                ot,
                TransferState.TIMED_OUT,
                TransferError(
                    StatusCode.LEASE_EXPIRED, "no ACK before the lease on the source blocks expired"
                ),
                "lease_expired",
            )
        elif now > ot.deadline:
            last = f"; last error: {ot.last_error.message}" if ot.last_error else ""
            self._close(
                ot,
                TransferState.TIMED_OUT,
                TransferError(
                    StatusCode.TIMEOUT,
                    f"not acknowledged within its deadline (phase {ot.phase}){last}",
                ),
                "timeout",
            )
        elif ot.phase == "backoff" and now >= ot.retry_at:
            self._attempt(ot)
        elif ot.phase != "backoff" and now > ot.attempt_until:
            self._retry(ot, TransferError(StatusCode.TIMEOUT, f"no answer in phase {ot.phase}"))

    def renew(self, request_id: str, now: float, seconds: float | None = None) -> int:
        """Extend the source-block leases of our pushes for ``request_id``; how many."""
        count = 0
        for ot in self.active.values():
            if ot.handle.request_id == request_id and ot.closing is None:
                ot.lease_until = max(ot.lease_until, now + (seconds or ot.lease_s))
                count += 1
        return count

    def extend_lease(self, transfer_id: str, until: float) -> None:
        """Move one transfer's lease (and deadline) to ``until`` (a renewed offer's)."""
        ot = self.active.get(transfer_id)
        if ot is not None and ot.closing is None:
            ot.lease_until = max(ot.lease_until, until)
            ot.deadline = max(ot.deadline, until)

    # ---- links --------------------------------------------------------------------------
    def on_linked(self, session: Session) -> None:
        """A (re-)link completed: resume transfers waiting for it."""
        for ot in list(self.active.values()):
            if ot.phase == "link" and ot.handle.peer == session.peer_id and ot.closing is None:
                self._attempt(ot)

    def on_link_failed(self, peer: str, err: TransferError) -> None:
        """A handshake failed: transfers waiting for it retry (or fail if non-recoverable)."""
        for ot in list(self.active.values()):
            if ot.phase == "link" and ot.handle.peer == peer and ot.closing is None:
                (self._retry if err.recoverable else self._fail)(ot, err)

    def on_data_unusable(self, session: Session) -> None:
        """The peer's data channel cannot be reached: stream transfers on it go over the
        link instead, now rather than after their attempt times out."""
        err = TransferError(StatusCode.LINK_FAILED, "data channel unreachable: using the link")
        for ot in list(self.active.values()):
            if ot.session is session and ot.via_data and ot.closing is None:
                self._retry(ot, err)

    def on_session_lost(self, session: Session, reason: str) -> None:
        """Transfers on a dropped session wait for a new link until their attempt times out."""
        for ot in self.active.values():
            if ot.session is session and ot.closing is None:
                ot.session, ot.phase = None, "link"

    # ---- ending -------------------------------------------------------------------------
    def _fail(self, ot: OutTransfer, err: TransferError) -> None:
        state = (
            TransferState.CANCELLED if err.code is StatusCode.CANCELLED else TransferState.FAILED
        )
        self._close(ot, state, err, "cancelled" if state is TransferState.CANCELLED else "failed")

    def _close(
        self, ot: OutTransfer, state: TransferState, err: TransferError | None, released: str
    ) -> None:
        tm = self.core.metrics.of(ot.transport or "tcp")
        if state is TransferState.DONE:
            tm.transfers_done_total += 1
            tm.observe(ot.handle.nbytes, time.monotonic() - ot.handle.created)
        elif state is TransferState.TIMED_OUT:
            tm.transfers_timed_out_total += 1
        else:
            tm.transfers_failed_total += 1
        ot.closing, ot.phase = (state, err, released), "closing"
        ot.queue.clear()
        if ot.queued and self.core.datachan is not None:
            self.core.datachan.cancel(ot)
        if (
            ot.inflight
            and ot.session is not None
            and ot.session.outbound
            and state is not TransferState.DONE
        ):
            self.core.linker.relink(ot.session)  # discard queued zero-copy frames
        if ot.inflight == 0:
            self._release(ot)

    def _release(self, ot: OutTransfer) -> None:
        assert ot.closing is not None
        self.active.pop(ot.handle.transfer_id, None)
        self.core.finish(ot.handle, *ot.closing)
        if ot.on_closed is not None:
            ot.on_closed(ot.closing[0])

    def cancel(self, handle: TransferHandle) -> None:
        """Caller-requested cancel."""
        ot = self.active.get(handle.transfer_id)
        if ot is not None and ot.closing is None:
            self._fail(ot, TransferError(StatusCode.CANCELLED, "cancelled by the caller"))

    def abort_all(self, err: TransferError) -> None:
        """Engine shutdown."""
        for ot in list(self.active.values()):
            self.core.finish(ot.handle, TransferState.FAILED, err, "failed")
        self.active.clear()

    def held_ids(self) -> dict[str, set[int]]:
        """Source blocks held by unfinished transfers, per region (for leak checks)."""
        held: dict[str, set[int]] = {}
        for ot in list(self.active.values()):  # also read from caller threads
            held.setdefault(ot.region.name, set()).update(ot.src_ids.tolist())
        return held

"""Receiving side: validates transfers into reserved blocks, verifies, commits, ACKs.

Nothing from the network is written anywhere before it passed, in order: frame validation
(:mod:`transfer.wire`), the session check, BEGIN's validation against the region and the
reservation it names, which must be granted to that peer (:mod:`transfer.incoming`), the
chunk's place in the plan and its checksum. Writes happen through the ledger, which refuses
them once the reservation was released. A transfer id is committed at most once: repeats
are answered with ``ACK(dup=True)`` and nothing is written::

    BEGIN  ─> accept_begin ─> [direct] GRANT {until}   [stream] wait for chunks
    DATA   ─> planned? ours? checksum ok? ─> write_if_current ─> good[seq] = 1
    LANDED ─> [direct] DirectChecks: verify the chunks in our blocks (transfer.direct_checks)
    END    ─> every chunk good (direct: DirectChecks reads back what is not verified yet)?
              no  -> ACK {code, bad=[seq...]}  (the sender resends those)
              yes -> commit_if_current -> ACK ok -> reservation DONE once every layer came
"""

from __future__ import annotations

import time
from collections.abc import Callable

from transfer import aead, checksum, kv_codec, kv_layouts, layout, wire
from transfer.config import TransferConfig
from transfer.direct_checks import DirectChecks
from transfer.errors import StatusCode, TransferError
from transfer.handle import TransferState
from transfer.hashing import Hasher
from transfer.incoming import DIRECT, InTransfer, accept_begin
from transfer.ledger import Ledger, Reservation
from transfer.loop import IOLoop
from transfer.messages import Ack, Begin, Data, End, Error, Grant, Landed
from transfer.metrics import Metrics
from transfer.outbox import Outbox
from transfer.region import KVRegion
from transfer.session import Identity, Session


class Receiver:
    """All incoming transfers of one engine (I/O thread only)."""

    def __init__(
        self,
        me: Identity,
        config: TransferConfig,
        loop: IOLoop,
        outbox: Outbox,
        ledger: Ledger,
        regions: dict[str, KVRegion],
        metrics: Metrics,
        hasher: Hasher,
    ) -> None:
        self.me, self.config, self.loop, self.outbox = me, config, loop, outbox
        self.ledger, self.regions, self.metrics, self.hasher = ledger, regions, metrics, hasher
        self.active: dict[str, InTransfer] = {}
        #: Told the id of every transfer committed here (a pull we asked for may be done).
        self.on_committed: Callable[[str], None] = lambda transfer_id: None
        self._next_tick = 0.0
        self.direct = DirectChecks(metrics, hasher, self.still_verifying, self.resume_end)

    # ---- replies ------------------------------------------------------------------------
    def _refuse(self, session: Session, transfer_id: str, err: TransferError) -> None:
        if err.code is StatusCode.STALE_EPOCH:
            self.metrics.of("tcp").stale_epoch_rejections_total += 1
        elif err.code is StatusCode.NOT_GRANTED:
            self.metrics.reject("not_granted")
        self.outbox.post(session, Error.of(transfer_id, err))

    def _ack(
        self,
        session: Session,
        transfer_id: str,
        code: StatusCode = StatusCode.SUCCESS,
        text: str = "",
        bad: list[int] | None = None,
        dup: bool = False,
    ) -> None:
        ack = Ack(
            transfer_id=transfer_id, code=code.number, text=text, bad=bad or [], duplicate=dup
        )
        self.outbox.post(session, ack)

    # ---- begin --------------------------------------------------------------------------
    def on_begin(self, session: Session, msg: Begin) -> None:
        """Validate a new transfer against our reservation; grant direct writers a window."""
        transfer_id, fingerprint = msg.transfer_id, (msg.request_id, msg.epoch)
        seen = self.ledger.committed(transfer_id)
        if seen is not None:
            mode = msg.mode if msg.mode in DIRECT else "tcp"
            self.metrics.of(mode).duplicates_total += 1
            if seen == fingerprint:
                self._ack(session, transfer_id, dup=True)
            else:
                err = TransferError(
                    StatusCode.REPEAT_REQUEST, f"transfer id {transfer_id!r} was another request's"
                )
                self._refuse(session, transfer_id, err)
            return
        incoming = self.active.get(transfer_id)
        try:
            if incoming is not None and incoming.peer != session.peer_id:
                raise TransferError(
                    StatusCode.NOT_GRANTED, f"transfer id {transfer_id!r} belongs to another peer"
                )
            if incoming is not None and incoming.fingerprint != fingerprint:
                raise TransferError(
                    StatusCode.REPEAT_REQUEST, f"transfer id {transfer_id!r} in use"
                )
            if incoming is None:
                incoming = accept_begin(
                    msg,
                    session,
                    self.me,
                    self.regions,
                    self.ledger,
                    self.config.max_frame_bytes,
                    self.config.kv_codec,
                )
                self.active[transfer_id] = incoming
        except TransferError as err:
            self._refuse(session, transfer_id, err)
            return
        incoming.session, incoming.last_seen = session, time.monotonic()  # may be a new link
        incoming.begin_digest = aead.begin_digest(msg)  # this attempt's chunks are under it
        if incoming.mode in DIRECT:
            # an absolute deadline on our monotonic clock (direct writers share this host):
            # a grant that reaches the writer late is worth only what is left of it
            ttl = self.config.grant_s
            until = time.monotonic() + ttl
            incoming.early.clear()  # a new attempt writes every chunk again
            incoming.grant += 1  # claims about earlier attempts' copies no longer count
            blocks = incoming.dst_array.tolist()
            self.ledger.grant(transfer_id, incoming.region.name, blocks, until)
            grant = Grant(transfer_id=transfer_id, ttl=ttl, until=until, grant=incoming.grant)
            self.outbox.post(session, grant)

    # ---- chunks -------------------------------------------------------------------------
    def owned(self, session: Session, transfer_id: str) -> InTransfer | None:
        """The incoming transfer if ``session``'s peer is the one sending it (counted and
        None otherwise, or when it already committed)."""
        incoming = self.active.get(transfer_id)
        if incoming is not None and incoming.peer == session.peer_id:
            return incoming
        if incoming is not None:
            self.metrics.reject("not_granted")
        elif self.ledger.committed(transfer_id) is not None:
            self.metrics.of("tcp").duplicates_total += 1
        else:
            self.metrics.reject("unknown_transfer")
        return None

    def check_chunk(
        self, incoming: InTransfer, seq: int, tensor: int, lo: int, hi: int, size: int
    ) -> bool:
        """Validate a chunk's place and size (FrameError); False for a duplicate."""
        if incoming.mode != "tcp" or not incoming.is_planned(seq, tensor, lo, hi):
            raise wire.FrameError("bad_field", "data location")
        if size != incoming.chunk_nbytes(hi - lo):
            raise wire.FrameError("bad_size", f"{size} bytes for {hi - lo} blocks")
        incoming.last_seen = time.monotonic()
        if incoming.good[seq] or seq in incoming.verifying:
            self.metrics.of("tcp").duplicates_total += 1
            return False
        return True

    def open_sealed(
        self, session: Session, aad: bytes, msg: Data, sealed: memoryview
    ) -> memoryview:
        """A sealed chunk from the link, opened under its header and its transfer's BEGIN
        (a chunk of no transfer we hold is left as it is: :meth:`on_data` drops it)."""
        incoming = self.active.get(msg.transfer_id)
        if incoming is None or session.sealer is None:
            return sealed
        return session.sealer.open(aad + incoming.begin_digest, sealed)

    def on_data(
        self, session: Session, msg: Data, payload: memoryview, sealed: bool = False
    ) -> None:
        """Verify, then write one chunk that came as a ZMQ frame (or into staging); a
        ``sealed`` one was verified by its tag already (:mod:`transfer.aead`)."""
        incoming = self.owned(session, msg.transfer_id)
        if incoming is None:
            return
        seq, tensor, lo, hi = msg.seq, msg.tensor, msg.lo, msg.hi
        if not self.check_chunk(incoming, seq, tensor, lo, hi, len(payload)):
            return
        algo, digest = (None, None) if sealed else (incoming.algo, msg.digest)
        if algo is not None and (digest is None or checksum.digest(algo, payload) != digest):
            self.metrics.of("tcp").checksum_failures_total += 1
            incoming.bad_checksum.add(seq)
            return
        target = incoming.region.tensors[tensor]
        try:
            chunk = kv_codec.from_wire(
                incoming.codec,
                payload,
                hi - lo,
                incoming.src_block_shape,
                incoming.src_dtype,
                target.dtype,
            )
        except kv_codec.KVCodecError as exc:
            raise wire.FrameError("bad_field", str(exc)) from None

        def write() -> None:
            layout.scatter(
                target,
                incoming.dst_ids,
                kv_layouts.to_destination(
                    chunk, incoming.src_layout, incoming.region.layout, target
                ),
                lo,
                incoming.src_block_shape[0],
                incoming.num_tokens,
                incoming.dst_run,
            )

        try:
            self.ledger.write_if_current(incoming.reservation, write)
        except TransferError as err:
            self.reject_stale(incoming, err)
            return
        self._good(incoming, seq, len(payload))

    def landed(
        self,
        incoming: InTransfer,
        seq: int,
        data: memoryview,
        digest: int | None,
        computed: int | None = None,
        sealed: bool = False,
    ) -> None:
        """Chunk ``seq`` was read straight into its destination blocks: verify it, with the
        checksum ``computed`` as its bytes arrived or else there on a hashing thread (frames
        for ``seq`` are dropped until that is done); a ``sealed`` one was, by its tag."""
        algo = incoming.algo
        if algo is None or sealed:
            self._good(incoming, seq, len(data))
            return
        incoming.good[seq] = 0  # the blocks hold these bytes now, whatever came before
        if digest is None:
            self._bad(incoming, seq)
            return
        nbytes = len(data)
        if computed is not None:
            if computed == digest:
                self._good(incoming, seq, nbytes)
            else:
                self._bad(incoming, seq)
            return
        incoming.verifying.add(seq)

        def verdict(value: int | None) -> None:
            if not self.still_verifying(incoming, seq):
                return
            if value == digest:
                self._good(incoming, seq, nbytes)
            else:
                self._bad(incoming, seq)
            self.resume_end(incoming)

        self.hasher.then(self.hasher.submit_bytes(algo, data), verdict)

    def still_verifying(self, incoming: InTransfer, seq: int) -> bool:
        incoming.verifying.discard(seq)
        return self.active.get(incoming.transfer_id) is incoming

    def resume_end(self, incoming: InTransfer) -> None:
        """Handle an END that waited for verifications, once none is left."""
        if not incoming.verifying and incoming.pending_end is not None:
            (session, msg), incoming.pending_end = incoming.pending_end, None
            self.on_end(session, msg)

    def _bad(self, incoming: InTransfer, seq: int) -> None:
        self.metrics.of("tcp").checksum_failures_total += 1
        incoming.good[seq] = 0
        incoming.bad_checksum.add(seq)

    def _good(self, incoming: InTransfer, seq: int, nbytes: int) -> None:
        incoming.good[seq] = 1
        incoming.bad_checksum.discard(seq)
        incoming.nbytes += nbytes
        self.metrics.of("tcp").bytes_received_total += nbytes

    def reject_stale(self, incoming: InTransfer, err: TransferError) -> None:
        """The reservation behind ``incoming`` is gone: forget the transfer, tell the sender."""
        self._forget(incoming)
        self._refuse(incoming.session, incoming.transfer_id, err)

    # ---- end ----------------------------------------------------------------------------
    def on_end(self, session: Session, msg: End) -> None:
        """All chunks sent: verify completeness (direct writes: their digests), then commit."""
        transfer_id = msg.transfer_id
        incoming = self.active.get(transfer_id)
        if incoming is not None and incoming.peer != session.peer_id:
            err = TransferError(StatusCode.NOT_GRANTED, f"{transfer_id!r} is not yours")
            self._refuse(session, transfer_id, err)
            return
        if incoming is None:
            if self.ledger.committed(transfer_id) is not None:
                self._ack(session, transfer_id, dup=True)
            else:
                err = TransferError(
                    StatusCode.INCOMPLETE, f"unknown transfer {transfer_id!r}: send begin again"
                )
                self._refuse(session, transfer_id, err)
            return
        if incoming.verifying:  # wait for the hashing threads, then come back here
            incoming.pending_end = (session, msg)
            return
        counters = self.metrics.of(incoming.mode)
        if incoming.mode in DIRECT:
            if incoming.direct_verdict is None:
                self.ledger.end_grant(transfer_id)  # the writer is done: no more writes
                self.direct.check(incoming, msg.digests)
                if incoming.verifying:
                    incoming.pending_end = (session, msg)
                    return
            bad, incoming.direct_verdict = incoming.direct_verdict or [], None
            if bad:
                counters.checksum_failures_total += 1
                code = StatusCode.CHECKSUM_MISMATCH
                self._ack(session, transfer_id, code, "direct write mismatch", bad)
                return
        else:
            missing = [s for s in range(incoming.num_chunks) if not incoming.good[s]]
            if missing:
                code = (
                    StatusCode.CHECKSUM_MISMATCH if incoming.bad_checksum else StatusCode.INCOMPLETE
                )
                text = f"{len(missing)} of {incoming.num_chunks} chunks missing or bad"
                self._ack(session, transfer_id, code, text, missing)
                return
        try:
            complete = self.ledger.commit_if_current(
                transfer_id, incoming.fingerprint, incoming.reservation, incoming.layers
            )
        except TransferError as err:
            self.reject_stale(incoming, err)
            return
        del self.active[transfer_id]
        if incoming.mode in DIRECT:
            incoming.nbytes = (
                incoming.num_src_blocks * incoming.src_block_bytes * len(incoming.tensors)
            )
            counters.bytes_received_total += incoming.nbytes
        counters.transfers_received_total += 1
        counters.observe(incoming.nbytes, time.monotonic() - incoming.started)
        if complete:  # before the ACK: the sender's DONE may make decode run at once
            self.loop.finish(incoming.reservation.handle, TransferState.DONE)
        self._ack(session, transfer_id)
        self.on_committed(transfer_id)

    def on_landed(self, session: Session, msg: Landed) -> None:
        """A direct writer's chunks are in our blocks (:meth:`DirectChecks.on_landed`)."""
        incoming = self.owned(session, msg.transfer_id)
        if incoming is not None:
            self.direct.on_landed(incoming, msg)

    def _forget(self, incoming: InTransfer) -> None:
        self.active.pop(incoming.transfer_id, None)
        self.ledger.end_grant(incoming.transfer_id)

    # ---- reservations and deadlines -----------------------------------------------------
    def release(self, reservation: Reservation) -> None:
        """Forget transfers into a released reservation (their frames become stale)."""
        for incoming in [i for i in self.active.values() if i.reservation is reservation]:
            self._forget(incoming)

    def tick(self, now: float) -> None:
        """Deadlines: reservations that waited too long, abandoned incoming transfers."""
        if now < self._next_tick:
            return
        self._next_tick = now + 0.01
        for reservation in self.ledger.overdue(now):
            self.ledger.kill(reservation)
            err = TransferError(
                StatusCode.TIMEOUT,
                f"request {reservation.blocks.request_id!r}: KV not received in time; its "
                "blocks now refuse late writes, release() them",
            )
            self.loop.finish(reservation.handle, TransferState.TIMED_OUT, err)
        for incoming in list(self.active.values()):
            if now - incoming.last_seen > self.config.timeout_s:
                self._forget(incoming)

    def abort_all(self, err: TransferError) -> None:
        """Engine shutdown: every reservation fails."""
        for reservation in self.ledger.reservations():
            self.loop.finish(reservation.handle, TransferState.FAILED, err)

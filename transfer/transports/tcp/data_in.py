"""Receiving end of a data connection: parse frames, land chunks in the destination blocks.

A chunk whose destination is one contiguous run of CPU blocks of the same dtype and block
size is read with ``recv_into`` straight into those blocks; every read happens under the
ledger lock after checking that the reservation is still live, so a ``release()`` can never
race a write. Its digest is then computed over the blocks themselves and must match before
the chunk counts as good; a bad chunk leaves the blocks reserved but uncommitted (nothing
reads them) and is NACKed at END like any other. Other chunks (scattered blocks, another
dtype or block size, device memory) are read into a reusable staging buffer and go through
the same verify-then-scatter as ZMQ frames (:meth:`Receiver.on_data`), and so do the chunks
of a sealed session (:mod:`transfer.aead`), read whole into staging and opened straight
into their blocks (or into a second buffer, then scattered): the tag verifies them, so no
checksum is computed; one whose tag fails is dropped (``bad_mac``) and resent, one that is
not sealed is refused (``not_sealed``).

Duplicates, chunks of unknown or finished transfers and chunks that fail validation are read
into a scratch buffer and dropped (counted), so the stream stays in sync; a header that does
not validate closes the connection.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np

from transfer import aead, checksum, layout, wire
from transfer.config import TransferConfig
from transfer.errors import StatusCode, TransferError
from transfer.incoming import InTransfer
from transfer.ledger import Ledger
from transfer.messages import Begin, Data, End, tag
from transfer.metrics import Metrics
from transfer.receiver import Receiver
from transfer.session import Session
from transfer.transports.tcp import frames
from transfer.transports.tcp.frames import FrameHeader

log = logging.getLogger(__name__)
#: Bytes read from one connection per loop iteration before polling again.
READ_BUDGET = 16 << 20
#: Streams (BEGINs) remembered per connection.
MAX_STREAMS = 4096
_SCRATCH = bytearray(1 << 20)
#: A chunk landing in its blocks is read (and hashed) in pieces of at most this size, so
#: each piece is hashed while it is still in this core's cache.
HASH_PIECE = frames.HASH_PIECE
#: Staging buffers kept for sealed chunks (each opened on a hashing thread with its own).
SPARE_BUFFERS = 4


class DataIn:
    """One accepted data connection (receiving side)."""

    def __init__(
        self,
        sock: socket.socket,
        config: TransferConfig,
        metrics: Metrics,
        receiver: Receiver,
        ledger: Ledger,
        find_session: Callable[[bytes], Session | None],
        on_closed: Callable[[DataIn], None],
    ) -> None:
        self.sock, self.config, self.metrics = sock, config, metrics
        self.receiver, self.ledger = receiver, ledger
        self._find_session, self._on_closed = find_session, on_closed
        self.fd = sock.fileno()
        self.opened = time.monotonic()
        self.session: Session | None = None
        self.closed = False
        self.streams: OrderedDict[int, str] = OrderedDict()
        self._head = bytearray(frames.HEADER_BYTES)
        self._head_view = memoryview(self._head)
        self._head_got = 0
        self.frame: FrameHeader | None = None
        self._got = 0
        self._end = 0  # bytes of the current frame after its header: body (+ trailer)
        self._tail = bytearray(frames.TRAILER_BYTES)
        self._body: memoryview | None = None  # where the body goes; None: scratch (dropped)
        self._direct: InTransfer | None = None  # set when the body lands in dst blocks
        #: The landing body's checksum, fed as bytes arrive (still in the cache).
        self._running: checksum.Running | None = None
        self._staging = bytearray(0)
        self._plain = bytearray(0)  # a sealed chunk, opened (when it cannot land directly)
        #: Staging buffers back from sealed chunks opened on the hashing threads.
        self._spare: list[bytearray] = []
        self._aad = b""  # the header of the sealed chunk being read
        #: The transfer of the sealed chunk being read (None: not sealed, or dropped).
        self._sealed: InTransfer | None = None

    # ---- reading ------------------------------------------------------------------------
    def on_readable(self) -> None:
        """Read what the socket has (bounded), handling every frame completed."""
        moved = 0
        max_payload = self.config.max_frame_bytes
        while moved < READ_BUDGET and not self.closed:
            try:
                if self.frame is None:
                    n = self.sock.recv_into(self._head_view[self._head_got :])
                    if n:
                        self._head_got += n
                        if self._head_got == frames.HEADER_BYTES:
                            self._head_got = 0
                            self._start(frames.unpack(self._head, max_payload))
                else:
                    n = self._read_body(self.frame)
                    if n and self._got == self._end:
                        frame, self.frame = self.frame, None
                        self._finish(frame)
            except (BlockingIOError, InterruptedError):
                return
            except wire.FrameError as exc:
                self.metrics.reject(exc.reason)
                self.close(f"bad frame header: {exc}")
                return
            except OSError as exc:
                self.close(f"receive failed: {exc}")
                return
            if n == 0:
                self.close("peer closed")
                return
            moved += n

    def _read_body(self, frame: FrameHeader) -> int:
        if self._got >= frame.length:  # the digest trailer
            n = self.sock.recv_into(memoryview(self._tail)[self._got - frame.length :])
            self._got += n
            return n
        incoming = self._direct
        if incoming is not None:
            body = self._body
            assert body is not None
            stop = frame.length if self._running is None else self._got + HASH_PIECE

            def read() -> int:  # into the blocks, while the reservation still owns them
                return self.sock.recv_into(body[self._got : stop])

            try:
                n = self.ledger.write_if_current(incoming.reservation, read)
                if self._running is not None:
                    self._running.update(body[self._got : self._got + n])
                self._got += n
                return n
            except TransferError as err:
                self.receiver.reject_stale(incoming, err)
                self._direct = self._body = None  # the rest of the chunk is dropped
        if self._body is not None:
            n = self.sock.recv_into(self._body[self._got :])
        else:
            left = frame.length - self._got
            n = self.sock.recv_into(memoryview(_SCRATCH)[: min(left, len(_SCRATCH))])
        self._got += n
        return n

    # ---- frames -------------------------------------------------------------------------
    def _start(self, frame: FrameHeader) -> None:
        self.frame, self._got, self._body, self._direct = frame, 0, None, None
        self._end = frame.length + (frames.TRAILER_BYTES if frame.trailer else 0)
        self._running = None
        if self.session is None and frame.kind != frames.PREFACE:
            self.metrics.reject("data_unauthenticated")
            raise wire.FrameError("unauthenticated", "data connection without preface")
        if frame.kind != frames.DATA:
            self._body = self._buffer(frame.length)
            return
        try:
            self._start_data(frame)
        except wire.FrameError as exc:
            self.metrics.reject(exc.reason)

    def _start_data(self, frame: FrameHeader) -> None:
        transfer_id = self.streams.get(frame.stream)
        if transfer_id is None:
            raise wire.FrameError("unknown_transfer", f"stream {frame.stream}")
        assert self.session is not None
        if frame.sealed != (self.session.sealer is not None):
            raise wire.FrameError("not_sealed" if frame.sealed is False else "bad_field", "DATA")
        incoming = self.receiver.owned(self.session, transfer_id)
        if incoming is None:
            return
        if frame.sealed:  # read whole: its nonce is checked first, then the chunk (_open)
            self._body = self._buffer(frame.length)
            self._aad = bytes(self._head) + incoming.begin_digest
            self._sealed = incoming
            return
        seq, tensor, lo, hi = frame.seq, frame.ti, frame.lo, frame.hi
        if not self.receiver.check_chunk(incoming, seq, tensor, lo, hi, frame.length):
            return
        view = _destination(incoming, tensor, lo, hi)
        if view is None:
            self._body = self._buffer(frame.length)
            return
        if not incoming.reservation.alive:
            self.receiver.reject_stale(incoming, _released(incoming))
            return
        self._body, self._direct = view, incoming
        if incoming.algo is not None and (frame.digest is not None or frame.trailer):
            self._running = checksum.Running(incoming.algo)

    def _finish(self, frame: FrameHeader) -> None:
        body = self._body
        digest = int.from_bytes(self._tail, "little") if frame.trailer else frame.digest
        try:
            if frame.kind == frames.PREFACE:
                assert body is not None
                self._on_preface(bytes(body))
            elif frame.kind == frames.MESSAGE:
                assert body is not None
                self._on_message(frame, body)
            elif body is not None and self._direct is not None:
                computed = self._running.value() if self._running is not None else None
                self.receiver.landed(self._direct, frame.seq, body, digest, computed)
            elif body is not None and self._sealed is not None:
                self._open(frame, body, self._sealed)
            elif body is not None:
                self._staged(frame, body, digest)
        except wire.FrameError as exc:
            self.metrics.reject(exc.reason)
        except Exception:  # never let one frame kill the I/O thread
            log.exception("data frame failed")
            self.metrics.internal_errors_total += 1
            self.metrics.reject("internal_error")
        finally:
            self._body = self._direct = self._running = self._sealed = None

    def _staged(
        self, frame: FrameHeader, body: memoryview, digest: int | None, sealed: bool = False
    ) -> None:
        """A chunk read into staging (``sealed``: opened already), verified and scattered."""
        msg = Data(  # from a data-channel header, bounds checked by frames.unpack
            transfer_id=self.streams.get(frame.stream, ""),
            seq=frame.seq,
            tensor=frame.ti,
            lo=frame.lo,
            hi=frame.hi,
            digest=digest,
        )
        assert self.session is not None
        self.receiver.on_data(self.session, msg, body, sealed=sealed)

    def _open(self, frame: FrameHeader, body: memoryview, incoming: InTransfer) -> None:
        """A sealed chunk: refused if its nonce was taken before (a replay, checked before
        the duplicate check, which would drop it quietly), else checked like any chunk and
        opened into its blocks or, when it cannot land there, into a second buffer."""
        sealer = self.session.sealer if self.session is not None else None
        assert sealer is not None
        if not sealer.fresh(body):
            raise wire.FrameError("replay", "a sealed chunk received before")
        seq, tensor, lo, hi = frame.seq, frame.ti, frame.lo, frame.hi
        size = frame.length - aead.OVERHEAD
        if not self.receiver.check_chunk(incoming, seq, tensor, lo, hi, size):
            return
        view = _destination(incoming, tensor, lo, hi)
        if view is not None:
            self._open_into_blocks(seq, body, view, incoming)
            return
        if len(self._plain) < body.nbytes:
            self._plain = bytearray(body.nbytes)
        plain = memoryview(self._plain)[:size]
        sealer.open_into(self._aad, body, plain)
        self._staged(frame, plain, None, sealed=True)

    def _open_into_blocks(
        self, seq: int, body: memoryview, view: memoryview, incoming: InTransfer
    ) -> None:
        """Opens a sealed chunk straight into its blocks, while the reservation owns them (a
        failed tag leaves them uncommitted, the chunk not good: it is resent), on a hashing
        thread while this one reads the next chunk (AES-GCM releases the GIL): the staging
        buffer goes with the job, and the chunk is verifying until it is done (an END
        waits for it, a copy of it is a duplicate)."""
        sealer = self.session.sealer if self.session is not None else None
        assert sealer is not None
        staging, self._staging = self._staging, self._spare.pop() if self._spare else bytearray()
        aad, reservation = self._aad, incoming.reservation
        incoming.verifying.add(seq)
        sealer.claim(body)

        def job() -> Exception | bool:
            try:
                self.ledger.write_if_current(reservation, lambda: sealer.open_into(aad, body, view))
            except Exception as exc:  # delivered to the I/O thread, counted there
                return exc
            return True

        def opened(outcome: Exception | bool | None) -> None:  # the I/O thread
            if len(self._spare) < SPARE_BUFFERS:
                self._spare.append(staging)
            if not self.receiver.still_verifying(incoming, seq) or outcome is None:
                return  # the transfer ended meanwhile, or the engine closes
            if isinstance(outcome, TransferError):
                self.receiver.reject_stale(incoming, outcome)
                return
            if outcome is True:
                self.receiver.landed(incoming, seq, view, None, sealed=True)
            elif isinstance(outcome, wire.FrameError):
                self.metrics.reject(outcome.reason)
            else:
                log.error("opening a sealed chunk failed", exc_info=outcome)
                self.metrics.internal_errors_total += 1
                self.metrics.reject("internal_error")
            self.receiver.resume_end(incoming)

        hasher = self.receiver.hasher
        hasher.then(hasher.run(job), opened)

    def _on_preface(self, proof: bytes) -> None:
        if self.session is not None:
            raise wire.FrameError("unexpected_handshake", "second preface")
        session = self._find_session(proof)
        if session is None:
            self.metrics.reject("data_unauthenticated")
            self.close("unknown session token")
            return
        self.session = session
        self.metrics.data_links_total += 1

    def _on_message(self, frame: FrameHeader, body: memoryview) -> None:
        session = self.session
        assert session is not None
        if not session.alive:
            self.close("session ended")
            return
        header = wire.decode(body, 1)
        msg = header.msg
        if not isinstance(msg, Begin | End) or header.sid != session.token:
            raise wire.FrameError("unauthenticated", f"{tag(msg)} on the data channel")
        if not wire.authentic(body, session.mac_receive):
            raise wire.FrameError("bad_mac", f"{tag(msg)} altered or forged")
        session.take(header)
        if isinstance(msg, End):
            self.receiver.on_end(session, msg)
            return
        if msg.mode != "tcp":
            raise wire.FrameError("bad_field", "begin.mode on the data channel")
        self.streams[frame.stream] = msg.transfer_id
        self.streams.move_to_end(frame.stream)
        while len(self.streams) > MAX_STREAMS:
            self.streams.popitem(last=False)
        self.receiver.on_begin(session, msg)

    def _buffer(self, n: int) -> memoryview:
        """The first ``n`` bytes of the reusable staging buffer (grown, never shrunk)."""
        if len(self._staging) < n:
            self._staging = bytearray(n)
        return memoryview(self._staging)[:n]

    def close(self, reason: str) -> None:
        """Close the connection; a half-read chunk is simply never marked good."""
        if self.closed:
            return
        self.closed = True
        log.debug("data connection closed: %s", reason)
        self._on_closed(self)
        self.sock.close()


def _released(incoming: InTransfer) -> TransferError:
    blocks = incoming.reservation.blocks
    return TransferError(
        StatusCode.STALE_EPOCH, f"request {blocks.request_id!r} epoch {blocks.epoch} was released"
    )


def _destination(incoming: InTransfer, tensor: int, lo: int, hi: int) -> memoryview | None:
    """Bytes of destination blocks ``dst[lo:hi]`` of ``tensor`` if a chunk can land there."""
    target = incoming.region.tensors[tensor]
    if (
        incoming.codec != "none"  # encoded bytes are decoded from staging
        or target.device.type != "cpu"
        or target.dtype != incoming.src_dtype
        or incoming.region.layout != incoming.src_layout
        or int(target.shape[1]) != incoming.src_block_shape[0]
        or not target.is_contiguous()
    ):
        return None
    ids = incoming.dst_array[lo:hi]
    first = int(ids[0])
    if not incoming.dst_run and not (
        int(ids[-1]) - first == hi - lo - 1 and bool((np.diff(ids) == 1).all())
    ):
        return None
    out: Any = layout.as_bytes(target[first : first + hi - lo])
    return out

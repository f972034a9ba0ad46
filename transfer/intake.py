"""Receiving end of a data connection: parse frames, land chunks in the destination blocks.

A chunk whose destination is one contiguous run of CPU blocks of the same dtype and block
size is read with ``recv_into`` straight into those blocks; every read happens under the
ledger lock after checking that the reservation is still live, so a ``release()`` can never
race a write. Its digest is then computed over the blocks themselves and must match before
the chunk counts as good; a bad chunk leaves the blocks reserved but uncommitted (nothing
reads them) and is NACKed at END like any other. Other chunks (scattered blocks, another
dtype or block size, device memory) are read into a reusable staging buffer and go through
the same verify-then-scatter as ZMQ frames (:meth:`Receiver.on_data`).

Duplicates, chunks of unknown or finished transfers and chunks that fail validation are read
into a scratch buffer and dropped (counted), so the stream stays in sync; a header that does
not validate closes the connection.
"""

from __future__ import annotations

import hmac
import logging
import socket
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from transfer import auth, dataframe, layout, wire
from transfer.dataframe import FrameHeader
from transfer.errors import TransferError
from transfer.session import Session

if TYPE_CHECKING:
    from transfer.core import Core
    from transfer.receiver import InTransfer

log = logging.getLogger(__name__)
#: Bytes read from one connection per loop iteration before polling again.
READ_BUDGET = 16 << 20
#: Streams (BEGINs) remembered per connection.
MAX_STREAMS = 4096
_SCRATCH = bytearray(1 << 20)


class DataIn:
    """One accepted data connection (receiving side)."""

    def __init__(self, core: Core, sock: socket.socket, on_closed: Callable[[DataIn], None]):
        self.core, self.sock, self._on_closed = core, sock, on_closed
        self.fd = sock.fileno()
        self.opened = time.monotonic()
        self.session: Session | None = None
        self.closed = False
        self.streams: OrderedDict[int, str] = OrderedDict()
        self._head = bytearray(dataframe.HEADER_BYTES)
        self._head_view = memoryview(self._head)
        self._head_got = 0
        self.frame: FrameHeader | None = None
        self._got = 0
        self._body: memoryview | None = None  # where the body goes; None: scratch (dropped)
        self._direct: InTransfer | None = None  # set when the body lands in dst blocks
        self._staging = bytearray(0)

    # ---- reading ------------------------------------------------------------------------
    def on_readable(self) -> None:
        """Read what the socket has (bounded), handling every frame completed."""
        moved = 0
        max_payload = self.core.config.max_frame_bytes
        while moved < READ_BUDGET and not self.closed:
            try:
                if self.frame is None:
                    n = self.sock.recv_into(self._head_view[self._head_got :])
                    if n:
                        self._head_got += n
                        if self._head_got == dataframe.HEADER_BYTES:
                            self._head_got = 0
                            self._start(dataframe.unpack(self._head, max_payload))
                else:
                    n = self._read_body(self.frame)
                    if n and self._got == self.frame.length:
                        frame, self.frame = self.frame, None
                        self._finish(frame)
            except (BlockingIOError, InterruptedError):
                return
            except wire.FrameError as exc:
                self.core.metrics.reject(exc.reason)
                self.close(f"bad frame header: {exc}")
                return
            except OSError as exc:
                self.close(f"receive failed: {exc}")
                return
            if n == 0:
                self.close("peer closed")
                return
            moved += n

    def _read_body(self, f: FrameHeader) -> int:
        left = f.length - self._got
        it = self._direct
        if it is not None:
            ledger = self.core.ledger
            with ledger.lock:  # a live reservation still owns the blocks for this read
                if it.res.alive:
                    assert self._body is not None
                    n = self.sock.recv_into(self._body[self._got :])
                    self._got += n
                    return n
                try:
                    ledger.check(it.region.name, *it.fingerprint, it.dst_np)
                except TransferError as err:
                    self.core.receiver.reject_stale(it, err)
            self._direct = self._body = None  # the rest of the chunk is dropped
        if self._body is not None:
            n = self.sock.recv_into(self._body[self._got :])
        else:
            n = self.sock.recv_into(memoryview(_SCRATCH)[: min(left, len(_SCRATCH))])
        self._got += n
        return n

    # ---- frames -------------------------------------------------------------------------
    def _start(self, f: FrameHeader) -> None:
        self.frame, self._got, self._body, self._direct = f, 0, None, None
        if self.session is None and f.kind != dataframe.PREFACE:
            self.core.metrics.reject("data_unauthenticated")
            raise wire.FrameError("unauthenticated", "data connection without preface")
        if f.kind != dataframe.DATA:
            self._body = self._buffer(f.length)
            return
        try:
            self._start_data(f)
        except wire.FrameError as exc:
            self.core.metrics.reject(exc.reason)

    def _start_data(self, f: FrameHeader) -> None:
        tm = self.core.metrics.of("tcp")
        xid = self.streams.get(f.stream)
        if xid is None:
            raise wire.FrameError("unknown_transfer", f"stream {f.stream}")
        assert self.session is not None
        it = self.core.receiver.owned(self.session, xid)
        if it is None:
            return
        s, ti, lo, hi = f.seq, f.ti, f.lo, f.hi
        if it.mode != "tcp" or not (
            0 <= s < it.nf and ti in it.tensors and 0 <= lo < hi <= it.nsrc and hi - lo <= it.bpc
        ):
            raise wire.FrameError("bad_field", "data location")
        if f.length != (hi - lo) * it.src_block_bytes:
            raise wire.FrameError("bad_size", f"{f.length} bytes for {hi - lo} blocks")
        it.last_seen = time.monotonic()
        if it.good[s]:
            tm.duplicates_total += 1
            return
        view = _destination(it, ti, lo, hi)
        if view is None:
            self._body = self._buffer(f.length)
            return
        with self.core.ledger.lock:
            try:
                self.core.ledger.check(it.region.name, *it.fingerprint, it.dst_np)
            except TransferError as err:
                self.core.receiver.reject_stale(it, err)
                return
        self._body, self._direct = view, it

    def _finish(self, f: FrameHeader) -> None:
        body = self._body
        try:
            if f.kind == dataframe.PREFACE:
                assert body is not None
                self._on_preface(bytes(body))
            elif f.kind == dataframe.MESSAGE:
                assert body is not None
                self._on_message(f, body)
            elif body is not None and self._direct is not None:
                self.core.receiver.landed(self._direct, f.seq, body, f.digest)
            elif body is not None:
                xid = self.streams.get(f.stream, "")
                h = {"x": xid, "s": f.seq, "ti": f.ti, "lo": f.lo, "hi": f.hi, "d": f.digest}
                assert self.session is not None
                self.core.receiver.on_data(self.session, h, body)
        except wire.FrameError as exc:
            self.core.metrics.reject(exc.reason)
        except Exception:  # never let one frame kill the I/O thread
            log.exception("engine %s: data frame failed", self.core.engine_id)
            self.core.metrics.reject("internal_error")
        finally:
            self._body = self._direct = None

    def _on_preface(self, token: bytes) -> None:
        if self.session is not None:
            raise wire.FrameError("unexpected_handshake", "second preface")
        core = self.core
        for session in (*core.in_sessions.values(), *core.out_sessions.values()):
            expected = auth.data_proof(session.token, core.engine_id)
            if session.alive and hmac.compare_digest(expected, token):
                self.session = session
                core.metrics.data_links_total += 1
                return
        core.metrics.reject("data_unauthenticated")
        self.close("unknown session token")

    def _on_message(self, f: FrameHeader, body: memoryview) -> None:
        session = self.session
        assert session is not None
        if not session.alive:
            self.close("session ended")
            return
        msg_type, h = wire.decode(body, 1)
        if msg_type not in ("begin", "end") or not hmac.compare_digest(h["sid"], session.token):
            raise wire.FrameError("unauthenticated", f"{msg_type} on the data channel")
        if msg_type == "end":
            self.core.receiver.on_end(session, h)
            return
        if h["mode"] != "tcp":
            raise wire.FrameError("bad_field", "begin.mode on the data channel")
        self.streams[f.stream] = h["x"]
        self.streams.move_to_end(f.stream)
        while len(self.streams) > MAX_STREAMS:
            self.streams.popitem(last=False)
        self.core.receiver.on_begin(session, h)

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
        log.debug("engine %s: data connection closed: %s", self.core.engine_id, reason)
        self._on_closed(self)
        self.sock.close()


def _destination(it: InTransfer, ti: int, lo: int, hi: int) -> memoryview | None:
    """Bytes of destination blocks ``dst[lo:hi]`` of tensor ``ti`` if a chunk can land there."""
    t = it.region.tensors[ti]
    if (
        t.device.type != "cpu"
        or t.dtype != it.src_dtype
        or int(t.shape[1]) != it.src_shape[0]
        or not t.is_contiguous()
    ):
        return None
    ids = it.dst_np[lo:hi]
    first = int(ids[0])
    if not it.dst_run and not (
        int(ids[-1]) - first == hi - lo - 1 and bool((np.diff(ids) == 1).all())
    ):
        return None
    out: Any = layout.as_bytes(t[first : first + hi - lo])
    return out

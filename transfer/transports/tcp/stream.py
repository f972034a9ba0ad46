"""The stream (``tcp``) sender: an outgoing transfer's chunks as frames, on the session's
data channel (:mod:`transfer.transports.tcp.channel`) or, without one, as zero-copy ZMQ
frames on the link.

:mod:`transfer.sender` decides *when* (attempts, resends, ACKs); :func:`pump_stream` sends a
bounded slice per call::

    queue ──> _prepare (gather, kv codec, digest a few chunks ahead on the hashing threads)
          ──> data channel: DATA header + body [+ trailer digest, hashed behind the kernel]
          └─> ZMQ link:     Data message + body (zero copy, tracked until ZMQ let go)
    a sealed session (transfer.aead): the body sealed under the header (no digest: the tag),
    a few chunks ahead on the hashing threads (AES-GCM releases the GIL), so sealing the
    next chunks overlaps sending this one instead of adding to it
    stop at PUMP_BYTES moved, WINDOW_BYTES in flight, or a digest not ready yet

The direct counterpart is :mod:`transfer.transports.direct`.
"""

from __future__ import annotations

import itertools
from concurrent.futures import Future
from typing import Any

import zmq

from transfer import aead, checksum, kv_codec, layout
from transfer.hashing import Hasher
from transfer.messages import Begin, Data, End, tag
from transfer.metrics import TransportMetrics
from transfer.outbox import Outbox
from transfer.outgoing import PUMP_BYTES, OutTransfer, Phase
from transfer.transports.tcp import frames

#: Zero-copy bytes a stream transfer may have queued in ZMQ at once.
WINDOW_BYTES = 64 << 20
#: Stream chunks whose digests are computed ahead of sending, on the hashing threads.
PREFETCH_CHUNKS = 2


def pump_stream(
    out: OutTransfer, outbox: Outbox, counters: TransportMetrics, hasher: Hasher
) -> bool:
    """Send a bounded slice of chunks; True once every chunk has been handed over.

    Chunk digests are computed a few chunks ahead on the hashing threads, so hashing
    overlaps the socket writes; a chunk whose digest is not ready yet waits (the hashing
    thread wakes the loop when it is).
    """
    session = out.session
    assert session is not None
    if out.src_run is None:
        out.src_run = layout.is_run(out.src_ids)
    moved = 0
    # On the data channel a chunk's digest trails its body and is computed piece by piece
    # just before the kernel copies each piece (data_out.DataOut.flush), while it is cached.
    # With faults on it is computed here, before a fault may change the bytes. ``trail``:
    # the algorithm the data channel hashes with as it writes (None: digests here).
    sealer = session.sealer  # a sealed session: every chunk sealed, its tag its checksum
    trail = out.algo if out.via_data and not outbox.faults_on and sealer is None else None
    while out.queue and moved < PUMP_BYTES and out.inflight < WINDOW_BYTES:
        _prepare(out, hasher, not outbox.faults_on, trail is None and sealer is None)
        seq = out.queue[0]
        buf, pending = out.prepared[seq]
        if pending is not None and not pending.done():
            out.waiting_digest = True
            return False
        result = pending.result() if pending is not None else None
        del out.prepared[seq]
        chunk = out.chunks[seq]
        if sealer is not None:  # sealed ahead (_seal): the frame's header and sealed body
            assert result is not None
            header, sealed = result
            if out.via_data:
                owner = None if outbox.faults_on else out
                sent = outbox.send(session, "data", header, sealed, via_data=True, owner=owner)
            else:  # the DATA message is the sealed body's associated data
                sent = outbox.send(session, "data", header, sealed)
        elif out.via_data:
            header = frames.data(
                out.stream, seq, chunk.ti, chunk.lo, chunk.hi, len(buf), None, out.algo is not None
            )
            owner = None if outbox.faults_on else out
            sent = outbox.send(
                session,
                "data",
                header,
                buf,
                via_data=True,
                owner=owner,
                trailer=None if result is None else frames.trailer(result),
                hash_with=None if trail is None else checksum.Running(trail),
            )
        else:
            header = session.header(_data(out, seq, result))
            sent = outbox.send(session, "data", header, buf, track=not outbox.faults_on)
        if sent is False:
            out.prepared[seq] = (buf, pending)
            return False  # not connected (yet): the attempt timer decides
        if isinstance(sent, zmq.MessageTracker):
            out.trackers.append((sent, len(buf)))
        out.queue.popleft()
        moved += len(buf)
        counters.bytes_sent_total += len(buf)
        counters.chunks_sent_total += 1
        if out.phase is not Phase.SEND:
            return False  # the session went away under a fault; the attempt timer decides
    return not out.queue


def send_framing(outbox: Outbox, out: OutTransfer, msg: Begin | End) -> None:
    """BEGIN / END of ``out``: in band on the data channel, in order with the chunks they
    frame, or else on the link; each time a new frame (a new number: transfer.replay)."""
    if out.session is None:
        return  # the session went away; the attempt timer decides
    msg_type, header = tag(msg), out.session.header(msg)
    if out.via_data:
        frame = frames.message(out.stream, header)
        outbox.send(out.session, msg_type, frame, header, via_data=True)
    else:
        outbox.send(out.session, msg_type, header)


def _prepare(out: OutTransfer, hasher: Hasher, safe_views: bool, digests: bool) -> None:
    """Bytes (and, if ``digests``, digests) of the next few queued chunks."""
    for seq in itertools.islice(out.queue, PREFETCH_CHUNKS):
        if seq in out.prepared:
            continue
        chunk = out.chunks[seq]
        data = layout.gather(
            out.region.tensors[chunk.ti], out.src_ids[chunk.lo : chunk.hi], out.src_run
        )
        if not safe_views and data.device.type == "cpu":
            data = data.clone()  # faults may send it later or twice: never a view
        buf = layout.as_bytes(kv_codec.to_wire(out.codec, data))  # digests cover these bytes
        pending: Future[Any] | None = None
        if out.session is not None and out.session.sealer is not None:
            pending = hasher.run(_seal, out, seq, buf)
        elif out.algo and digests:
            pending = hasher.submit_bytes(out.algo, buf)
        if pending is not None:
            hasher.then(pending, lambda _: _ready(out))
        out.prepared[seq] = (buf, pending)


def _seal(out: OutTransfer, seq: int, buf: memoryview) -> tuple[bytes, memoryview]:
    """Chunk ``seq``'s frame in a sealed session (a hashing thread): its header (a data
    channel header, or a DATA message on the link) and its body sealed under it."""
    session = out.session
    assert session is not None and session.sealer is not None
    if out.via_data:
        chunk = out.chunks[seq]
        size = len(buf) + aead.OVERHEAD
        header = frames.data(out.stream, seq, chunk.ti, chunk.lo, chunk.hi, size, None, sealed=True)
    else:
        header = session.header(_data(out, seq, None))
    return header, session.sealer.seal(header + out.begin_digest, buf)


def _data(out: OutTransfer, seq: int, digest: int | None) -> Data:
    chunk = out.chunks[seq]
    return Data(
        transfer_id=out.handle.transfer_id,
        seq=seq,
        tensor=chunk.ti,
        lo=chunk.lo,
        hi=chunk.hi,
        digest=digest,
    )


def _ready(out: OutTransfer) -> None:
    out.waiting_digest = False  # runs on the I/O thread: the next pump sends the chunk

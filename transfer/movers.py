"""Outgoing transfer state and the code that moves its bytes (stream frames, direct copies).

:mod:`transfer.sender` decides *when* (attempts, retries, ACKs); this module decides *how*
the bytes of one attempt go out, a bounded slice per call so the I/O loop stays responsive.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import zmq

from transfer import checksum, dataframe, layout, wire
from transfer.devices import to_host
from transfer.errors import TransferError
from transfer.handle import RemoteBlocks, TransferHandle, TransferState
from transfer.region import KVRegion
from transfer.session import Session

if TYPE_CHECKING:
    from transfer.core import Core

#: Bytes moved per transfer per loop iteration before polling the sockets again.
PUMP_BYTES = 16 << 20
#: Zero-copy bytes a stream transfer may have queued in ZMQ at once.
WINDOW_BYTES = 64 << 20


@dataclass(slots=True, eq=False)
class OutTransfer:
    """State of one outgoing transfer (all attempts)."""

    handle: TransferHandle
    region: KVRegion
    src_ids: torch.Tensor
    dst: RemoteBlocks
    layers: tuple[int, int]
    num_tokens: int
    requested_algo: str | None
    forced: str | None
    deadline: float
    lease_until: float
    transport: str = ""
    session: Session | None = None
    algo: str | None = None
    chunks: list[layout.Chunk] = field(default_factory=list)
    bpc: int = 1
    queue: deque[int] = field(default_factory=deque)
    phase: str = "link"
    attempt_until: float = 0.0
    retry_at: float = 0.0
    grant_until: float = 0.0
    dst_tensors: list[torch.Tensor] | None = None
    #: ``layout.is_run(src_ids)``, computed once per transfer.
    src_run: bool | None = None
    trackers: deque[tuple[zmq.MessageTracker, int]] = field(default_factory=deque)
    #: Stream chunks go on the session's data channel (:mod:`transfer.datachan`).
    via_data: bool = False
    #: Our number for this transfer on the data channel (named by its BEGIN).
    stream: int = 0
    #: The msgpack BEGIN of the current attempt (resent in band before resent chunks).
    begin: bytes = b""
    #: Bytes of frames viewing our source blocks still queued on the data channel.
    queued: int = 0
    closing: tuple[TransferState, TransferError | None, str] | None = None
    last_error: TransferError | None = None
    #: Called on the I/O thread once the transfer ended and released its source blocks.
    on_closed: Callable[[TransferState], None] | None = None
    #: Direct writes: destination block ids as a tensor, and each chunk's digest (hashing).
    dst_ids: torch.Tensor | None = None
    digests: dict[int, Future[int]] = field(default_factory=dict)
    #: Seconds one renewal extends the lease by (the lease it started with).
    lease_s: float = 0.0

    @property
    def inflight(self) -> int:
        """Bytes handed out zero-copy (ZMQ or the data channel) and not yet released."""
        while self.trackers and self.trackers[0][0].done:
            self.trackers.popleft()
        return sum(n for _, n in self.trackers) + self.queued


def pump_stream(core: Core, ot: OutTransfer) -> bool:
    """Send a bounded slice of chunks; True once every chunk has been handed to ZMQ."""
    session = ot.session
    assert session is not None
    safe_views = core.injector is None
    if ot.src_run is None:
        ot.src_run = layout.is_run(ot.src_ids)
    moved = 0
    while ot.queue and moved < PUMP_BYTES and ot.inflight < WINDOW_BYTES:
        seq = ot.queue[0]
        c = ot.chunks[seq]
        data = layout.gather(ot.region.tensors[c.ti], ot.src_ids[c.lo : c.hi], ot.src_run)
        if not safe_views and data.device.type == "cpu":
            data = data.clone()
        host = to_host(data)
        buf = layout.as_bytes(host)
        digest = checksum.digest(ot.algo, buf) if ot.algo else None
        if ot.via_data:
            header = dataframe.data(ot.stream, seq, c.ti, c.lo, c.hi, len(buf), digest)
            owner = ot if safe_views else None
            sent = core.send(session, "data", header, buf, via_data=True, owner=owner)
        else:
            header = wire.encode(
                "data",
                session.token,
                x=ot.handle.transfer_id,
                s=seq,
                ti=c.ti,
                lo=c.lo,
                hi=c.hi,
                d=digest,
            )
            sent = core.send(session, "data", header, buf, track=safe_views)
        if sent is False:
            return False  # not connected (yet): the attempt timer decides
        if isinstance(sent, zmq.MessageTracker):
            ot.trackers.append((sent, len(buf)))
        ot.queue.popleft()
        moved += len(buf)
        core.metrics.of(ot.transport).bytes_sent_total += len(buf)
        if ot.phase != "send":
            return False  # the session went away under a fault; the attempt timer decides
    return not ot.queue


def pump_direct(core: Core, ot: OutTransfer) -> list[int] | None:
    """Copy a bounded slice into the mapped destination; the chunks' digests once done.

    Every chunk is copied only while the receiver's grant is open (checked before each
    one; chunks are at most ``chunk_bytes``, so a copy never runs long past the check). The
    digest of what each chunk should leave in the destination is computed on the hashing
    thread meanwhile; the receiver recomputes it from its blocks before it commits.
    Returns None while chunks remain or the grant ran out (the caller checks which).
    """
    assert ot.session is not None and ot.dst_tensors is not None
    if ot.dst_ids is None:
        ot.dst_ids = torch.tensor(ot.dst.block_ids, dtype=torch.long)
    moved = 0
    while ot.queue and moved < PUMP_BYTES:
        fault = core.injector.match("direct") if core.injector is not None else None
        if fault is not None and fault.kind == "delay":
            time.sleep(fault.delay_s)  # the writer is descheduled mid-transfer
        if time.monotonic() > ot.grant_until:
            return None
        seq = ot.queue.popleft()
        if fault is not None and fault.kind == "reorder" and ot.queue:
            ot.queue.append(seq)
            continue
        if fault is not None and fault.kind == "disconnect":
            core.linker.drop(ot.session, "fault: disconnect")
            return None
        moved += _copy_chunk(core, ot, seq, fault.kind if fault is not None else None)
    if ot.queue:
        return None
    if not ot.algo:
        return []
    return [ot.digests[seq].result() for seq in range(len(ot.chunks))]


def _copy_chunk(core: Core, ot: OutTransfer, seq: int, fault: str | None) -> int:
    assert ot.dst_tensors is not None and ot.dst_ids is not None
    c = ot.chunks[seq]
    dst = ot.dst_tensors[c.ti]
    block_size = ot.region.block_size
    data = layout.gather(ot.region.tensors[c.ti], ot.src_ids[c.lo : c.hi])
    data = data.to(device=dst.device, dtype=dst.dtype)
    if ot.algo and seq not in ot.digests:
        image = layout.sent_image(data, c.lo, block_size, int(dst.shape[1]), ot.num_tokens)
        ot.digests[seq] = core.hasher.submit(ot.algo, image)
    if fault == "corrupt":  # the copy lands one damaged byte (the digest is of the truth)
        data = data.clone()
        data.view(-1)[:1].view(torch.uint8)[0] ^= 0x5A
    if fault != "drop":
        for _ in range(2 if fault == "duplicate" else 1):
            layout.scatter(dst, ot.dst_ids, data, c.lo, block_size, ot.num_tokens)
    nbytes = data.numel() * data.element_size()
    core.metrics.of(ot.transport).bytes_sent_total += nbytes
    return int(nbytes)

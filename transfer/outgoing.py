"""One outgoing transfer's state across its attempts (`OutTransfer`, its `Phase`), a
validated push before it starts (`new_push`) and each attempt's plan and BEGIN
(`plan_attempt`). :mod:`transfer.sender` drives it;
:mod:`transfer.transports.direct` and :mod:`transfer.transports.tcp.stream` move its bytes."""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import zmq

from transfer import checksum, kv_layouts, layout
from transfer.config import TransferConfig
from transfer.errors import StatusCode, TransferError
from transfer.handle import RemoteBlocks, TransferHandle, TransferState
from transfer.messages import Begin, Transport
from transfer.region import KVRegion, dtype_name
from transfer.session import Session

#: Bytes moved per transfer per loop iteration before polling the sockets again.
PUMP_BYTES = 16 << 20


class Phase(enum.Enum):
    """Where the current attempt of an outgoing transfer is (diagram: :mod:`transfer.sender`)."""

    LINK = "link"  # waiting for a session to the peer
    GRANT = "grant"  # direct: BEGIN sent, waiting for the receiver's write window
    DIRECT = "direct"  # direct: copying chunks into the peer's blocks
    SEND = "send"  # stream: sending chunks
    ACK = "ack"  # END sent, waiting for the ACK
    BACKOFF = "backoff"  # waiting to start the next attempt
    CLOSING = "closing"  # ended: waiting until no queued frame views the source blocks


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
    blocks_per_chunk: int = 1
    queue: deque[int] = field(default_factory=deque)
    phase: Phase = Phase.LINK
    attempt_until: float = 0.0
    retry_at: float = 0.0
    grant_until: float = 0.0
    dst_tensors: list[torch.Tensor] | None = None
    #: Direct writes: the destination region's block layout (its description's ``fmt``).
    dst_layout: str = kv_layouts.ND
    #: ``layout.is_run(src_ids)``, computed once per transfer.
    src_run: bool | None = None
    trackers: deque[tuple[zmq.MessageTracker, int]] = field(default_factory=deque)
    #: Stream chunks go on the session's data channel (:mod:`transfer.transports.tcp.channel`).
    via_data: bool = False
    #: Our number for this transfer on the data channel (named by its BEGIN).
    stream: int = 0
    #: The BEGIN of the current attempt (resent in band before resent chunks, each time as a
    #: new frame: a frame sent twice is a replay, :mod:`transfer.replay`).
    begin: Begin | None = None
    #: :func:`transfer.aead.begin_digest` of that BEGIN (sealed chunks are sealed under it).
    begin_digest: bytes = b""
    #: Bytes of frames viewing our source blocks still queued on the data channel.
    queued: int = 0
    closing: tuple[TransferState, TransferError | None, str] | None = None
    last_error: TransferError | None = None
    #: Called on the I/O thread once the transfer ended and released its source blocks.
    on_closed: Callable[[TransferState, TransferError | None], None] | None = None
    #: Direct writes: destination block ids as a tensor (and whether they are a run), and
    #: each chunk's digest (computed as it is first copied).
    dst_ids: torch.Tensor | None = None
    dst_ids_for: list[torch.Tensor] | None = None  # the mapping ``dst_ids`` were checked in
    dst_run: bool | None = None
    digests: dict[int, int] = field(default_factory=dict)
    #: Direct writes: chunks of this attempt whose landed bytes we hashed right after
    #: copying them and found equal to their digest (the receiver need not read them again).
    verified: set[int] = field(default_factory=set)
    #: Direct writes whose chunks are plain byte runs (:func:`_plain_runs`): per tensor, the
    #: address of the first source and destination block, and the bytes of one block;
    #: computed with ``dst_ids`` (None: not such a write, or not known yet).
    plain: tuple[list[int], list[int], int] | None = None
    #: Direct writes: the receiver's number for the grant we write under (LANDED names it).
    grant: int = 0
    #: Seconds one renewal extends the lease by (the lease it started with).
    lease_s: float = 0.0
    #: Stream chunks ready to send: their bytes and (with checksums) their digest's future,
    #: or (sealed) the future of their frame: header and sealed body (transports.tcp.stream).
    prepared: dict[int, tuple[memoryview, Future[Any] | None]] = field(default_factory=dict)
    #: True while the next chunk waits for its digest (the hashing thread wakes the loop).
    waiting_digest: bool = False
    #: How stream chunks are encoded on the wire (named in BEGIN; direct writes: "none").
    codec: str = "none"

    @property
    def on_cpu(self) -> bool:
        """Both ends of a direct write in host memory (its chunks may be copied two at once)."""
        dst = self.dst_tensors
        return self.region.tensors[0].is_cpu and dst is not None and all(t.is_cpu for t in dst)

    @property
    def inflight(self) -> int:
        """Bytes handed out zero-copy (ZMQ or the data channel) and not yet released."""
        while self.trackers and self.trackers[0][0].done:
            self.trackers.popleft()
        return sum(n for _, n in self.trackers) + self.queued


def new_push(
    transfer_id: str,
    peer: str,
    region: KVRegion,
    src: list[int],
    dst: RemoteBlocks,
    layers: tuple[int, int],
    num_tokens: int | None,
    checksum_algo: str | None,
    transport: str | None,
    timeout_s: float,
    lease_s: float,
) -> OutTransfer:
    """A validated push of ``src`` (layers ``[first, last)``) into ``dst``, not started yet."""
    region.check_blocks(src, "source")
    if not src:
        raise TransferError(StatusCode.PARAM_INVALID, "no source blocks")
    tokens = num_tokens if num_tokens is not None else len(src) * region.block_size
    if not 0 < tokens <= len(src) * region.block_size:
        raise TransferError(StatusCode.PARAM_INVALID, f"num_tokens={tokens} for {len(src)} blocks")
    nbytes = len(src) * region.block_bytes * len(region.tensor_range(layers))
    handle = TransferHandle(transfer_id, "push", peer, dst.request_id, nbytes=nbytes)
    now = time.monotonic()
    src_ids = torch.tensor(src, dtype=torch.long)
    return OutTransfer(
        handle,
        region,
        src_ids,
        dst,
        layers,
        tokens,
        checksum_algo,
        transport,
        now + timeout_s,
        now + lease_s,
        lease_s=lease_s,
    )


def plan_attempt(out: OutTransfer, config: TransferConfig, direct: bool) -> Begin:
    """Plan the next attempt of ``out`` over its chosen transport (checksum, codec, chunks,
    queue) and return the BEGIN that announces it."""
    out.algo = _checksum(out, config, direct)
    out.codec = "none" if direct else config.kv_codec
    num_blocks = out.src_ids.numel()
    # direct copies are chunked too: the grant window is checked before every chunk
    out.blocks_per_chunk = layout.blocks_per_chunk(
        out.region.block_bytes, config.chunk_bytes, num_blocks
    )
    out.chunks = layout.plan(out.region.tensor_range(out.layers), num_blocks, out.blocks_per_chunk)
    out.queue = deque(range(len(out.chunks)))
    out.prepared.clear()
    return Begin(
        transfer_id=out.handle.transfer_id,
        request_id=out.dst.request_id,
        epoch=out.dst.epoch,
        region=out.dst.region,
        dst=list(out.dst.block_ids),
        num_src=num_blocks,
        dtype=dtype_name(out.region.dtype),
        block_size=out.region.block_size,
        tensors_per_layer=out.region.tensors_per_layer,
        block_shape=list(out.region.block_shape),
        layers=out.layers,
        num_tokens=out.num_tokens,
        num_chunks=len(out.chunks),
        blocks_per_chunk=out.blocks_per_chunk,
        checksum=out.algo,
        mode=cast(Transport, out.transport),  # transports.choose() picked it
        codec=out.codec,
        layout=out.region.layout,
    )


def _checksum(out: OutTransfer, config: TransferConfig, direct: bool) -> str | None:
    if out.requested_algo == "off":
        return None
    if out.requested_algo is not None:
        return checksum.resolve(out.requested_algo)
    on = config.checksums_on(direct)
    return checksum.resolve(config.checksum_algo) if on else None

"""Direct writes (``local``, ``shm``, ``cuda_ipc``): copy an outgoing transfer's chunks into
the peer's mapped destination blocks, verifying each as it lands.

:mod:`transfer.sender` decides *when* (grants, attempts, ACKs); this module decides *how*
the bytes of one attempt are copied, a bounded slice per call so the I/O loop stays
responsive::

    pump_direct ──> [no faults, host memory] _copy_in_two: this thread + a helper, one queue
         │                                      each chunk: _copy_plain (by address: one C
         │                                      call copies and hashes it, where built) or
         └──> [otherwise] _pump_one_by_one ──>  _copy_chunk ─> _copy_verified (hash as it lands)
    every LANDED_BYTES: landed(seqs) ──> LANDED {wv: verified here | not} to the receiver

The stream (``tcp``) counterpart is :mod:`transfer.transports.tcp.stream`.
"""

from __future__ import annotations

import ctypes
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, wait
from typing import Any

import torch

from transfer import checksum, kv_layouts, layout
from transfer.errors import StatusCode, TransferError
from transfer.faults import FaultInjector
from transfer.hashing import tensor_digest
from transfer.messages import Landed
from transfer.metrics import TransportMetrics
from transfer.outgoing import PUMP_BYTES, OutTransfer
from transfer.session import Session

#: Direct copies hash what they copy in pieces of about this size (fits in a core's cache).
PIECE_BYTES = 512 << 10
#: The C loop (``backends.xxh3_io``, where built) copies and hashes pieces this small: the
#: source and destination piece both still in L1 (32 KiB here) when hashed, and no Python
#: per piece to pay for (16-64 KiB measured alike, 256 KiB and more worse).
NATIVE_PIECE_BYTES = 16 << 10
#: A direct writer reports landed chunks (LANDED) every this many bytes: the receiver then
#: verifies them while they are still in the shared cache and the next ones are copied.
LANDED_BYTES = 4 << 20


def pump_direct(
    out: OutTransfer,
    injector: FaultInjector | None,
    counters: TransportMetrics,
    drop: Callable[[Session, str], None],
    landed: Callable[[list[int]], None],
    helper: Callable[..., Future[Any]] | None = None,
) -> list[int] | None:
    """Copy a bounded slice into the mapped destination; the chunks' digests once done.

    Every chunk is copied only while the receiver's grant is open (checked before each
    one; chunks are at most ``chunk_bytes``, so a copy never runs long past the check). Each
    chunk is verified piece by piece as it is copied (:func:`_copy_verified`) where it can
    be; ``landed(seqs)`` is told the chunks copied every ``LANDED_BYTES``, so the receiver
    verifies any the writer could not while the next ones are copied. With ``helper`` (runs
    ``fn(*args)`` on another thread: ``Hasher.run``) and no faults to inject, host-memory
    chunks are copied by two threads (:func:`_copy_in_two`), with one LANDED per slice.
    Returns None while chunks remain or the grant ran out (the caller checks which).
    """
    assert out.session is not None and out.dst_tensors is not None
    if out.dst_ids is None or out.dst_ids_for is not out.dst_tensors:  # a new mapping too
        num_blocks = min(int(t.shape[0]) for t in out.dst_tensors)
        needed = -(-out.num_tokens // int(out.dst_tensors[0].shape[1]))
        out.dst_ids = _inside(out.dst.block_ids, num_blocks, needed, out.num_tokens)
        out.dst_ids_for = out.dst_tensors
        out.dst_run = layout.is_run(out.dst_ids)
        if out.src_run is None:
            out.src_run = layout.is_run(out.src_ids)
        out.plain = _plain_runs(out)
    if helper is not None and injector is None and len(out.queue) > 1 and out.on_cpu:
        done, nbytes = _copy_in_two(out, helper)
        counters.bytes_sent_total += nbytes
        counters.chunks_sent_total += len(done)
        if done and out.algo:
            landed(done)  # one LANDED for the slice: its chunks are all copied by now
    elif not _pump_one_by_one(out, injector, counters, drop, landed):
        return None
    if out.queue:
        return None
    if not out.algo:
        return []
    return [out.digests[seq] for seq in range(len(out.chunks))]


def landed_reports(out: OutTransfer, seqs: list[int]) -> list[Landed]:
    """LANDED messages for chunks ``seqs`` now in the receiver's blocks: those verified in
    its blocks as they were copied (``wv``), and the others, which the receiver verifies
    then, in parallel with our next copies, instead of all at END."""
    mine = [seq for seq in seqs if seq in out.verified]
    theirs = [seq for seq in seqs if seq not in out.verified]
    return [
        Landed(
            transfer_id=out.handle.transfer_id,
            seqs=group,
            digests=[out.digests[seq] for seq in group],
            writer_verified=verified,
            grant=out.grant,
        )
        for group, verified in ((mine, True), (theirs, False))
        if group
    ]


def _inside(block_ids: tuple[int, ...], num_blocks: int, needed: int, tokens: int) -> torch.Tensor:
    """The granted destination blocks: enough for the ``tokens`` we copy (``needed``), all
    inside the mapped region (the grant comes from the peer: a block past its region, or too
    few blocks for what we copy, would make a copy write outside the mapping)."""
    if len(block_ids) < needed:
        raise TransferError(
            StatusCode.KV_CACHE_NOT_EXIST,
            f"the grant names {len(block_ids)} destination blocks; {tokens} tokens need {needed}",
        )
    ids = torch.tensor(block_ids, dtype=torch.long)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= num_blocks):
        raise TransferError(
            StatusCode.KV_CACHE_NOT_EXIST,
            f"the grant names blocks outside the peer's region of {num_blocks} blocks",
        )
    return ids


def _pump_one_by_one(
    out: OutTransfer,
    injector: FaultInjector | None,
    counters: TransportMetrics,
    drop: Callable[[Session, str], None],
    landed: Callable[[list[int]], None],
) -> bool:
    """`pump_direct`'s slice on this thread alone, a chunk at a time (faults apply here).
    False when the session was dropped (a fault)."""
    assert out.session is not None
    moved, unreported, done = 0, 0, []
    while out.queue and moved < PUMP_BYTES:
        fault = injector.match("direct") if injector is not None else None
        if fault is not None and fault.kind == "delay":
            time.sleep(fault.delay_s)  # the writer is descheduled mid-transfer
        if time.monotonic() > out.grant_until:
            break
        seq = out.queue.popleft()
        if fault is not None and fault.kind == "reorder" and out.queue:
            out.queue.append(seq)
            continue
        if fault is not None and fault.kind == "disconnect":
            drop(out.session, "fault: disconnect")
            return False
        nbytes = _copy_chunk(out, seq, fault.kind if fault is not None else None)
        done.append(seq)
        moved += nbytes
        counters.bytes_sent_total += nbytes
        counters.chunks_sent_total += 1
        unreported += nbytes
        if unreported >= LANDED_BYTES and out.algo:  # verified while still in the L3 cache
            landed(done)
            done, unreported = [], 0
    if done and out.algo:
        landed(done)
    return True


def _copy_in_two(out: OutTransfer, helper: Callable[..., Future[Any]]) -> tuple[list[int], int]:
    """Up to two slices' worth of chunks copied by two threads, this one and the helper, each
    taking the next chunk when it is done with one (the helper starts late and the threads
    go at different speeds, so fixed halves left one of them waiting); the copies and hashes
    release the GIL, so two cores' worth of memory traffic goes on at once. Each chunk starts
    only while the grant is open; those that did not go back to the front of the queue, in
    order. Returns the chunks copied and the bytes written."""
    take: list[int] = []
    nbytes = 0
    while out.queue and nbytes < 2 * PUMP_BYTES:
        take.append(out.queue.popleft())
        nbytes += _chunk_bytes(out, take[-1])
    shared = deque(take)  # popleft and appendleft are atomic: the threads share it as is
    # An error on either thread fails the whole transfer (Sender.pump), so the chunks of
    # this slice need not go back to the queue then.
    other = helper(_copy_shared, out, shared)
    try:
        mine, mine_bytes = _copy_shared(out, shared)
    finally:
        wait([other])  # never leave a copy running behind a failure
    theirs, their_bytes = other.result()
    started = set(mine) | set(theirs)
    out.queue.extendleft(reversed([seq for seq in take if seq not in started]))
    return [seq for seq in take if seq in started], mine_bytes + their_bytes


def _copy_shared(out: OutTransfer, shared: deque[int]) -> tuple[list[int], int]:
    """Copies chunks taken from the front of ``shared`` while the grant is open; returns
    those copied and the bytes written (the destination's, after any layout or dtype
    conversion). A chunk taken after the grant closed is left in ``shared``."""
    copied, nbytes = [], 0
    while True:
        try:
            seq = shared.popleft()
        except IndexError:
            break
        if time.monotonic() > out.grant_until:
            shared.appendleft(seq)
            break
        nbytes += _copy_chunk(out, seq, None)
        copied.append(seq)
    return copied, nbytes


def _chunk_bytes(out: OutTransfer, seq: int) -> int:
    chunk = out.chunks[seq]
    return (chunk.hi - chunk.lo) * out.region.block_bytes


def _plain_runs(out: OutTransfer) -> tuple[list[int], list[int], int] | None:
    """Addresses for :func:`_copy_plain` when every chunk of this direct write is one run of
    whole blocks copied byte for byte: source and destination blocks are runs, in host
    memory, contiguous, of the same dtype, block shape and layout, with checksums on."""
    dst = out.dst_tensors
    assert dst is not None and out.dst_ids is not None
    src = out.region.tensors
    if not (out.algo and out.src_run and out.dst_run and out.src_ids.numel()):
        return None
    if out.region.layout != out.dst_layout or len(dst) != len(src):
        return None
    for s, d in zip(src, dst, strict=True):
        if not (
            s.is_cpu
            and d.is_cpu
            and s.dtype == d.dtype
            and s.shape[1:] == d.shape[1:]
            and s.is_contiguous()
            and d.is_contiguous()
        ):
            return None
    block, n = out.region.block_bytes, int(out.src_ids.numel())
    first_src, first_dst = int(out.src_ids[0]), int(out.dst_ids[0])
    if int(out.dst_ids.numel()) != n or first_src < 0 or first_dst < 0:
        return None  # pump_direct refuses such a grant first; never copy by address then
    if any(first_src + n > s.shape[0] for s in src) or any(first_dst + n > d.shape[0] for d in dst):
        return None
    return (
        [t.data_ptr() + first_src * block for t in src],
        [t.data_ptr() + first_dst * block for t in dst],
        block,
    )


def _bytes_at(address: int, n: int) -> Any:
    """A buffer over ``n`` bytes at ``address`` (memory a tensor we hold owns)."""
    return (ctypes.c_char * n).from_address(address)


def _copy_plain(out: OutTransfer, seq: int, plain: tuple[list[int], list[int], int]) -> int:
    """:func:`_copy_verified` for a plain run, by address: no tensor is made or indexed per
    chunk (each torch call hands the GIL over, which two copying threads pay for), only
    memmove and xxh3, which run without the GIL. Where the C kernel is built
    (``backends.xxh3_io``) the whole chunk is one call: each 16 KiB piece copied, then that
    piece of the source and of the destination hashed while both are in L1."""
    assert out.algo is not None
    chunk = out.chunks[seq]
    src_base, dst_base, block = plain
    offset, nbytes = chunk.lo * block, (chunk.hi - chunk.lo) * block
    src, dst = src_base[chunk.ti] + offset, dst_base[chunk.ti] + offset
    source = None if seq in out.digests else checksum.Running(out.algo, native=True)
    landed = checksum.Running(out.algo, native=True)
    native = landed.native
    if native is not None and (source is None or source.native is not None):
        # one C loop: each piece copied, then the source and what landed hashed at once
        fed = None if source is None else source.native
        native.io.copy(dst, src, nbytes, NATIVE_PIECE_BYTES, fed, native)
    else:
        for lo in range(0, nbytes, PIECE_BYTES):
            n = min(PIECE_BYTES, nbytes - lo)
            ctypes.memmove(dst + lo, src + lo, n)
            if source is not None:
                source.update(_bytes_at(src + lo, n))
            landed.update(_bytes_at(dst + lo, n))
    if source is not None:
        out.digests[seq] = source.value()
    if landed.value() == out.digests[seq]:
        out.verified.add(seq)
    return nbytes


def _copy_chunk(out: OutTransfer, seq: int, fault: str | None) -> int:
    """Copy chunk ``seq`` into the destination, verifying it as it goes where it can."""
    assert out.dst_tensors is not None and out.dst_ids is not None
    out.verified.discard(seq)
    if fault is None and out.plain is not None:
        return _copy_plain(out, seq, out.plain)
    chunk = out.chunks[seq]
    dst = out.dst_tensors[chunk.ti]
    block_size = out.region.block_size
    ids = out.src_ids[chunk.lo : chunk.hi]
    data = layout.gather(out.region.tensors[chunk.ti], ids, out.src_run)
    data = kv_layouts.to_destination(data, out.region.layout, out.dst_layout, dst)
    nbytes = int(data.numel() * data.element_size())
    fused = (
        out.algo is not None
        and fault in (None, "corrupt")
        and data.device.type == "cpu"
        and int(dst.shape[1]) == block_size
    )
    if fused:
        _copy_verified(out, seq, data, dst, corrupt=fault == "corrupt")
        return nbytes
    if out.algo is not None and seq not in out.digests:
        image = layout.sent_image(data, chunk.lo, block_size, int(dst.shape[1]), out.num_tokens)
        out.digests[seq] = tensor_digest(out.algo, image)
    if fault == "corrupt":  # the copy lands one damaged byte (the digest is of the truth)
        data = data.clone()
        _damage(data)
    if fault != "drop":
        for _ in range(2 if fault == "duplicate" else 1):
            layout.scatter(
                dst, out.dst_ids, data, chunk.lo, block_size, out.num_tokens, out.dst_run
            )
    return nbytes


def _copy_verified(
    out: OutTransfer, seq: int, data: torch.Tensor, dst: torch.Tensor, corrupt: bool
) -> None:
    """Copy chunk ``seq`` piece by piece, hashing each piece twice while it is in this
    core's cache: the source (the chunk's digest, once per transfer) and what landed in
    the destination. Equal digests make the chunk verified by the writer; otherwise the
    receiver reads it back itself and NACKs it. ``corrupt`` (a fault) damages one landed
    byte, so the writer's check must catch it.
    """
    assert out.algo is not None and out.dst_ids is not None
    chunk, block_size = out.chunks[seq], out.region.block_size
    source = None if seq in out.digests else checksum.Running(out.algo)
    landed = checksum.Running(out.algo)
    n = data.shape[0]
    ids = out.dst_ids[chunk.lo : chunk.lo + n]
    if data.is_contiguous() and (out.dst_run or layout.is_run(ids)):
        # one run of blocks: plain byte copies (one memcpy per piece, no tensor dispatch)
        first = int(ids[0])
        target = dst[first : first + n]
        src, dst_bytes = layout.as_bytes(data), layout.as_bytes(target)
        if len(src) != len(dst_bytes) or not target.is_contiguous():
            raise AssertionError("a direct copy's source and destination differ in size")
        for lo in range(0, len(src), PIECE_BYTES):
            hi = min(lo + PIECE_BYTES, len(src))
            # ctypes.memmove releases the GIL (a memoryview slice assignment holds it), so
            # a helper thread copies another chunk at the same time (pump_direct)
            ctypes.memmove(target.data_ptr() + lo, data.data_ptr() + lo, hi - lo)
            if corrupt and lo == 0:
                dst_bytes[0] ^= 0x5A
            if source is not None:
                source.update(src[lo:hi])
            landed.update(dst_bytes[lo:hi])
    else:
        step = max(1, PIECE_BYTES // max(out.region.block_bytes, 1))
        for i in range(0, n, step):
            piece, lo = data[i : i + step], chunk.lo + i
            layout.scatter(dst, out.dst_ids, piece, lo, block_size, out.num_tokens, out.dst_run)
            if corrupt and i == 0:
                _damage(dst[int(out.dst_ids[lo])])
            if source is not None:
                source.update(layout.as_bytes(piece))
            image = layout.landed_image(
                dst, out.dst_ids, lo, piece.shape[0], block_size, out.num_tokens, out.dst_run
            )
            landed.update(layout.as_bytes(image))
    if source is not None:
        out.digests[seq] = source.value()
    if landed.value() == out.digests[seq]:
        out.verified.add(seq)


def _damage(t: torch.Tensor) -> None:
    """Flip bits of ``t``'s first byte (fault injection)."""
    t.view(-1)[:1].view(torch.uint8)[0] ^= 0x5A

"""The TCP data channel: chunks land in the destination blocks; strangers are refused."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Any

import pytest

from transfer import RemoteBlocks, TransferEngine, TransferState, checksum, hashing
from transfer.checksum import Buffer
from transfer.outbox import Part
from transfer.session import Session
from transfer.testing import PeerProcess, blocks_digest
from transfer.transports.tcp import frames
from transfer.transports.tcp.channel import DataChannel

from .conftest import Pair

SRC = [2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
RUN = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]  # contiguous: received straight into blocks
SCATTERED = [40, 31, 42, 33, 44, 35, 46, 37, 48, 39]  # through the staging buffer


def _rejected(peer: PeerProcess, reason: str) -> int:
    return peer.counts().metrics.rejected(reason)


def _closed_by_peer(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("dst", [RUN, SCATTERED], ids=["contiguous", "scattered"])
def test_push_goes_over_the_data_channel(
    receiver: PeerProcess, make_engine: Callable[..., TransferEngine], dst: list[int]
) -> None:
    eng = make_engine()
    eng.link(receiver.engine_id, receiver.address)
    before = receiver.counts().metrics
    blocks = RemoteBlocks.from_wire(receiver.call("reserve", rid=f"dc-{dst[1]}", ids=dst))
    h = eng.push_blocks(receiver.engine_id, SRC, blocks, transport="tcp")
    assert h.wait(10) is TransferState.DONE, h.error
    assert receiver.call("digest", ids=dst) == blocks_digest(eng.region(), SRC)
    after = receiver.counts().metrics
    assert after.data_links_total == before.data_links_total + 1
    received = after.transport("tcp").bytes_received_total
    assert received - before.transport("tcp").bytes_received_total == h.nbytes
    receiver.call("release", rid=f"dc-{dst[1]}")
    assert eng.held_blocks() == {}


@pytest.mark.parametrize(
    ("kind", "msg_type"), [("corrupt", "data"), ("drop", "end"), ("disconnect", "data")]
)
def test_zmq_data_path_still_works_when_switched_off(
    receiver: PeerProcess, make_engine: Callable[..., TransferEngine], kind: str, msg_type: str
) -> None:
    eng = make_engine(data_channel=False, faults=[{"kind": kind, "msg_type": msg_type, "nth": 2}])
    assert eng.data_address == ""
    eng.link(receiver.engine_id, receiver.address)
    links = receiver.counts().metrics.data_links_total
    rid = f"zmq-{kind}-{msg_type}"
    blocks = RemoteBlocks.from_wire(receiver.call("reserve", rid=rid, ids=RUN))
    h = eng.push_blocks(receiver.engine_id, SRC, blocks, transport="tcp")
    assert h.wait(10) is TransferState.DONE, h.error
    assert receiver.call("digest", ids=RUN) == blocks_digest(eng.region(), SRC)
    assert receiver.counts().metrics.data_links_total == links
    receiver.call("release", rid=rid)


def _connect(peer: PeerProcess) -> socket.socket:
    host, _, port = peer.data_address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=5)


def test_unknown_token_is_refused_and_counted(receiver: PeerProcess) -> None:
    before = _rejected(receiver, "data_unauthenticated")
    with _connect(receiver) as sock:
        sock.sendall(b"".join(frames.preface(b"\x01" * 16)))
        assert _closed_by_peer(sock)
    assert _rejected(receiver, "data_unauthenticated") == before + 1


def test_data_before_preface_is_refused(receiver: PeerProcess) -> None:
    before = _rejected(receiver, "data_unauthenticated")
    with _connect(receiver) as sock:
        sock.sendall(frames.data(1, 0, 0, 0, 1, 1024, None) + b"\x00" * 1024)
        assert _closed_by_peer(sock)
    assert _rejected(receiver, "data_unauthenticated") == before + 1


def test_garbage_and_oversized_headers_close_the_connection(receiver: PeerProcess) -> None:
    before = receiver.counts().metrics.frames_rejected_total
    with _connect(receiver) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\n" * 4)
        assert _closed_by_peer(sock)
    with _connect(receiver) as sock:
        sock.sendall(
            frames.HEADER.pack(frames.MAGIC, frames.VERSION, 3, 0, 1, 0, 0, 0, 1, 1 << 40, 0)
        )
        assert _closed_by_peer(sock)
    assert receiver.counts().metrics.frames_rejected_total >= before + 2


def test_header_round_trip_and_bounds() -> None:
    raw = frames.data(7, 3, 2, 10, 12, 4096, 0xDEADBEEF)
    h = frames.unpack(raw, 1 << 20)
    assert (h.kind, h.stream, h.seq, h.ti, h.lo, h.hi) == (frames.DATA, 7, 3, 2, 10, 12)
    assert (h.length, h.digest) == (4096, 0xDEADBEEF)
    assert frames.unpack(frames.data(1, 0, 0, 0, 1, 8, None), 64).digest is None
    with pytest.raises(Exception, match="oversized"):
        frames.unpack(raw, 1024)
    with pytest.raises(Exception, match="malformed"):
        frames.unpack(b"XXXX" + raw[4:], 1 << 20)


def test_trailer_flag_round_trip_and_bounds() -> None:
    h = frames.unpack(frames.data(7, 3, 2, 10, 12, 4096, None, trailer=True), 1 << 20)
    assert (h.trailer, h.digest, h.length) == (True, None, 4096)
    assert frames.trailer(0xDEADBEEF) == (0xDEADBEEF).to_bytes(frames.TRAILER_BYTES, "little")
    both = frames.HEADER.pack(frames.MAGIC, frames.VERSION, frames.DATA, 3, 1, 0, 0, 0, 1, 8, 5)
    with pytest.raises(Exception, match="malformed"):  # a digest in the header and a trailer
        frames.unpack(both, 64)
    message = frames.HEADER.pack(
        frames.MAGIC, frames.VERSION, frames.MESSAGE, 2, 1, 0, 0, 0, 0, 8, 0
    )
    with pytest.raises(Exception, match="malformed"):  # trailers are for DATA only
        frames.unpack(message, 64)


def _digest_in_a_trailer(parts: list[Part]) -> list[Part]:
    """A DATA frame as senders before 2026-12-06 sent it: its digest after the body."""
    head = frames.unpack(parts[0], 1 << 30)
    if head.kind != frames.DATA or head.digest is None:
        return parts
    header = frames.data(head.stream, head.seq, head.ti, head.lo, head.hi, head.length, None, True)
    return [header, parts[1], frames.trailer(head.digest)]


@pytest.mark.parametrize("flipped", [False, True])
def test_a_digest_in_a_trailer_is_still_understood(
    make_pair: Callable[..., Pair], monkeypatch: pytest.MonkeyPatch, flipped: bool
) -> None:
    """Senders of the version before hashed each chunk as they wrote it and sent its digest
    after the body (flag ``trailer``): their chunks land and verify as before, and one whose
    trailer does not match its bytes (the first) is caught and resent."""
    send = DataChannel.send
    wrong = [flipped]

    def older(chan: DataChannel, session: Session, parts: list[Part], owner: Any) -> bool:
        parts = _digest_in_a_trailer(parts)
        if len(parts) == 3 and wrong[0]:
            wrong[0] = False
            parts[2] = frames.trailer(int.from_bytes(parts[2], "little") ^ 1)
        return send(chan, session, parts, owner)

    monkeypatch.setattr(DataChannel, "send", older)
    p, d = make_pair()
    dst = list(range(20, 60))  # one run: received straight into the blocks
    recv = d.reserve("trailers", dst, writer=p.engine_id)
    assert recv.blocks is not None
    src = list(range(1, 41))
    h = p.push_blocks(d.engine_id, src, recv.blocks, transport="tcp")
    assert h.wait(10) is TransferState.DONE, h.error
    assert d.metrics().data_links_total == 1  # it went over the data channel
    assert d.metrics().transport("tcp").checksum_failures_total == (1 if flipped else 0)
    assert blocks_digest(d.region(), dst) == blocks_digest(p.region(), src)
    d.release("trailers")


def _hashing_threads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every chunk that lands in its blocks is hashed behind the reads whatever its size
    (these chunks are a few KiB); returns the names of the threads that hashed them."""
    monkeypatch.setattr(hashing, "BEHIND_BYTES", 0)
    names: list[str] = []
    whole = checksum.digest

    def digest(algo: str, data: Buffer) -> int:
        names.append(threading.current_thread().name)
        return whole(algo, data)

    monkeypatch.setattr(checksum, "digest", digest)
    return names


@pytest.mark.parametrize("fault", [None, "corrupt"])
def test_landed_chunks_are_verified_on_the_hashing_threads(
    make_pair: Callable[..., Pair], monkeypatch: pytest.MonkeyPatch, fault: str | None
) -> None:
    """The receiver's I/O thread reads the next chunk while a hashing thread verifies the
    one that landed, and END waits for every verdict: a byte flipped on the way (the second
    chunk) is caught there and that chunk alone is resent; the blocks end equal."""
    names = _hashing_threads(monkeypatch)
    faults = [{"kind": "corrupt", "msg_type": "data", "nth": 2}] if fault else []
    p, d = make_pair(sender={"faults": faults})
    dst = list(range(20, 60))  # one run: received straight into the blocks
    recv = d.reserve("behind", dst, writer=p.engine_id)
    assert recv.blocks is not None
    src = list(range(1, 41))
    h = p.push_blocks(d.engine_id, src, recv.blocks, transport="tcp")
    assert h.wait(10) is TransferState.DONE, h.error
    assert recv.wait(5) is TransferState.DONE
    assert d.metrics().data_links_total == 1  # it went over the data channel
    tcp = d.metrics().transport("tcp")
    assert tcp.checksum_failures_total == (1 if fault else 0)
    assert blocks_digest(d.region(), dst) == blocks_digest(p.region(), src)
    verified = [n for n in names if n.startswith(f"hash-{d.engine_id}")]
    # every chunk sent (the resent one too) verified there, none on the receiver's I/O thread
    assert len(verified) == p.metrics().transport("tcp").chunks_sent_total
    assert not any(n.startswith(f"transfer-{d.engine_id}") for n in names)
    d.release("behind")

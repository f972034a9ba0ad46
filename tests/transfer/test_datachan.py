"""The TCP data channel: chunks land in the destination blocks; strangers are refused."""

from __future__ import annotations

import socket
from collections.abc import Callable

import pytest

from transfer import RemoteBlocks, TransferEngine, TransferState, envs
from transfer.testing import PeerProcess, blocks_digest
from transfer.transports.tcp import data_in, data_out, frames

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


@pytest.mark.parametrize(
    ("l2", "piece"),
    [(1 << 20, 768 << 10), (512 << 10, 384 << 10), (128 << 10, 256 << 10),
     (8 << 20, 2 << 20), (None, 768 << 10)],
)  # fmt: skip
def test_hash_pieces_follow_the_l2_cache(
    monkeypatch: pytest.MonkeyPatch, l2: int | None, piece: int
) -> None:
    """Three quarters of the core's L2, within 256 KiB - 2 MiB; the variable overrides it
    and a piece too small to be one is refused by name."""
    monkeypatch.delenv("HETERO_PD_HASH_PIECE_BYTES", raising=False)
    assert envs.hash_piece_bytes(l2) == piece
    monkeypatch.setenv("HETERO_PD_HASH_PIECE_BYTES", "65536")
    assert envs.hash_piece_bytes(l2) == 65536
    monkeypatch.setenv("HETERO_PD_HASH_PIECE_BYTES", "100")
    with pytest.raises(ValueError, match="HETERO_PD_HASH_PIECE_BYTES"):
        envs.hash_piece_bytes(l2)


@pytest.mark.parametrize("piece", [1000, 4096])
def test_trailer_digest_is_hashed_as_the_kernel_takes_each_piece(
    make_pair: Callable[..., Pair], monkeypatch: pytest.MonkeyPatch, piece: int
) -> None:
    """Chunks of many pieces (odd sizes too): the digest computed while writing matches
    the receiver's, piece by piece, so nothing is NACKed and the blocks are equal."""
    monkeypatch.setattr(data_out, "HASH_PIECE", piece)
    monkeypatch.setattr(data_in, "HASH_PIECE", piece)
    p, d = make_pair()
    dst = list(range(20, 60))  # one run: received straight into the blocks
    recv = d.reserve("pieces", dst, writer=p.engine_id)
    assert recv.blocks is not None
    src = list(range(1, 41))
    h = p.push_blocks(d.engine_id, src, recv.blocks, transport="tcp")
    assert h.wait(10) is TransferState.DONE, h.error
    assert h.attempts == 1
    assert d.metrics().data_links_total == 1  # it went over the data channel
    assert d.metrics().transport("tcp").checksum_failures_total == 0
    assert blocks_digest(d.region(), dst) == blocks_digest(p.region(), src)
    d.release("pieces")

"""KV sealed in transit (transfer.aead): a capture of the loopback traffic between two
engines holds none of the KV bytes they moved, on the data channel and on the link; a
flipped bit fails the tag and the chunk is resent; the ends agree on sealing or refuse the
link. The same capture with sealing off finds the bytes (so the search can fail)."""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
import pytest

from transfer import StatusCode, TransferEngine, TransferError, TransferState, aead, layout, wire
from transfer.messages import Begin
from transfer.testing import make_config
from transfer.transports.tcp import frames

from .conftest import FAST, Pair, push_tcp

SRC, DST = [1, 2, 3, 4, 5, 6], [10, 11, 12, 13, 14, 15]
SO_RCVBUFFORCE = 33  # Linux: a receive buffer past rmem_max (root); Python names it not


class LoopbackCapture:
    """Every TCP packet on the loopback interface to or from ``ports`` while it runs (a raw
    packet socket: root). Other tests' loopback traffic (pytest-xdist) is left out, so it
    cannot fill the buffer before this test's push."""

    def __init__(self, ports: set[int]) -> None:
        self.ports = ports
        try:
            self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
        except (PermissionError, AttributeError):
            pytest.skip("capturing loopback traffic needs CAP_NET_RAW on Linux")
        # a busy machine must not drop packets before the thread reads them
        self.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 256 << 20)
        self.sock.bind(("lo", 0))
        self.sock.settimeout(0.05)
        self.data = bytearray()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _keep(self, frame: bytes) -> None:
        if len(frame) < 38 or frame[12:14] != b"\x08\x00" or frame[23] != socket.IPPROTO_TCP:
            return
        tcp = 14 + (frame[14] & 0x0F) * 4
        if {struct.unpack_from("!H", frame, tcp + i)[0] for i in (0, 2)} & self.ports:
            self.data += frame

    def _run(self) -> None:
        while not self.stop.is_set() and len(self.data) < 256 << 20:
            try:
                self._keep(self.sock.recv(1 << 17))
            except TimeoutError:
                continue
        # a slow reader (a busy CI host) still has packets queued when told to stop
        self.sock.setblocking(False)
        while len(self.data) < 256 << 20:
            try:
                self._keep(self.sock.recv(1 << 17))
            except BlockingIOError:
                break

    def __enter__(self) -> LoopbackCapture:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()


@pytest.fixture
def capture() -> Iterator[Callable[[set[int]], LoopbackCapture]]:
    yield LoopbackCapture


def _ports(*engines: TransferEngine) -> set[int]:
    """The listening ports of ``engines`` (control link and data channel)."""
    addrs = [e.address for e in engines] + [e.data_address for e in engines]
    return {int(a.rsplit(":", 1)[1]) for a in addrs if a}


def _samples(p: TransferEngine) -> list[bytes]:
    """48-byte pieces of the KV about to be pushed, from every tensor."""
    out = []
    for t in p.region().tensors:
        raw = bytes(layout.as_bytes(t[SRC].contiguous()))
        out += [raw[i : i + 48] for i in range(0, len(raw) - 48, len(raw) // 4)]
    return out


@pytest.mark.parametrize("data_channel", [True, False], ids=["data-channel", "link"])
def test_a_capture_between_engines_holds_no_kv_byte(
    make_pair: Callable[..., Pair],
    capture: Callable[[set[int]], LoopbackCapture],
    data_channel: bool,
) -> None:
    for encrypt in ("on", "off"):
        spec = {"encrypt": encrypt, "transports": ["tcp"], "data_channel": data_channel}
        p, d = make_pair(spec, spec)
        with capture(_ports(p, d)) as cap:
            push_tcp(p, d, f"sealed-{encrypt}", SRC, DST)
        found = [s for s in _samples(p) if s in cap.data]
        if encrypt == "on":
            assert found == [], f"{len(found)} KV pieces in clear on the wire"
        else:  # the same search finds them in clear: the capture sees this traffic
            assert len(found) >= len(_samples(p)) // 2, (len(found), len(_samples(p)))


@pytest.mark.parametrize("data_channel", [True, False], ids=["data-channel", "link"])
def test_a_flipped_bit_fails_the_tag_and_the_chunk_is_resent(
    make_pair: Callable[..., Pair], data_channel: bool
) -> None:
    flip = [{"kind": "corrupt", "msg_type": "data", "nth": 2}]
    spec = {"encrypt": "on", "transports": ["tcp"], "data_channel": data_channel}
    p, d = make_pair({**spec, "faults": flip, "checksum": False}, spec)
    push_tcp(p, d, "flipped", SRC, DST)
    assert d.metrics().rejected("bad_mac") == 1
    assert p.metrics().faults_injected_total == 1


def test_the_ends_agree_on_sealing_or_refuse_to_link() -> None:
    assert [aead.agree("auto", "auto", same) for same in (True, False)] == [False, True]
    assert aead.agree("on", "auto", True) and not aead.agree("off", "auto", False)
    p = TransferEngine("p-enc", "prefill", make_config({**FAST, "encrypt": "on"}))
    d = TransferEngine("d-enc", "decode", make_config({**FAST, "encrypt": "off"}))
    try:
        with pytest.raises(TransferError) as info:
            p.link(d.engine_id, d.address)
        assert info.value.code is StatusCode.PARAM_INVALID and "encrypt" in info.value.message
        assert d.metrics().rejected("encrypt_mismatch") == 1
    finally:
        p.close()
        d.close()
    with pytest.raises(ValueError, match="encrypt"):
        make_config({**FAST, "encrypt": "maybe"})


def test_a_sealed_chunk_that_cannot_land_directly_is_opened_then_converted() -> None:
    """float32 sent, float16 kept: the sealed chunk is opened into staging, then converted
    and scattered (on the data channel; the blocks path is the capture test's)."""
    import torch

    from transfer import KVRegion
    from transfer.testing import fill

    spec = {**FAST, "encrypt": "on", "transports": ["tcp"]}
    p = TransferEngine("p-enc16", "prefill", make_config(spec))
    d = TransferEngine("d-enc16", "decode", make_config(spec))
    try:
        src = KVRegion.allocate("kv", 2, 16, (16, 2, 8))
        fill(src, 9)
        p.register_region(src)
        dst = KVRegion.allocate("kv", 2, 16, (16, 2, 8), torch.float16)
        d.register_region(dst)
        p.link(d.engine_id, d.address)
        recv = d.reserve("f16", [7, 3])
        assert recv.blocks is not None
        h = p.push_blocks(d.engine_id, [0, 1], recv.blocks, transport="tcp")
        assert h.wait(10) is TransferState.DONE, h.error
        for got, want in zip(dst.tensors, src.tensors, strict=True):
            assert torch.equal(got[[7, 3]], want[[0, 1]].to(torch.float16))
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("data_channel", [True, False], ids=["data-channel", "link"])
def test_a_begin_rewritten_in_transit_never_commits_misplaced_kv(
    make_pair: Callable[..., Pair], data_channel: bool
) -> None:
    """BEGIN travels in clear with the session token, which a man in the middle sees, and
    its CRC is no MAC: one that reverses the destination blocks would make sealed chunks
    land in each other's place. Chunks are sealed under their BEGIN too, so they fail
    instead, and the transfer never commits."""
    spec = {"encrypt": "on", "transports": ["tcp"], "data_channel": data_channel}
    p, d = make_pair({**spec, "timeout_s": 3.0}, spec)
    outbox = p._core.outbox  # the wire, as the man in the middle rewrites it
    send = outbox.send

    def rewritten(
        session: Any, msg_type: str, header: bytes, payload: Any = None, **kw: Any
    ) -> Any:
        if msg_type != "begin":
            return send(session, msg_type, header, payload, **kw)
        raw = payload if kw.get("via_data") else header
        envelope = wire.decode(memoryview(raw), 1)
        assert isinstance(envelope.msg, Begin)
        msg = msgspec.structs.replace(envelope.msg, dst=envelope.msg.dst[::-1])
        raw = wire.encode(msg, envelope.sid)
        if kw.get("via_data"):
            stream = frames.unpack(header, 1 << 20).stream
            return send(session, msg_type, frames.message(stream, raw), raw, **kw)
        return send(session, msg_type, raw, payload, **kw)

    outbox.send = rewritten  # type: ignore[method-assign]
    recv = d.reserve("reversed", DST)
    assert recv.blocks is not None
    h = p.push_blocks(d.engine_id, SRC, recv.blocks, transport="tcp")
    assert h.wait(10) is not TransferState.DONE, "KV committed into the wrong blocks"
    assert d.metrics().rejected("bad_mac") > 0


def test_sealed_bodies_are_reused_only_once_nothing_holds_them() -> None:
    """A fresh 4 MiB body costs page faults and zeroing (a third of sealing it): the sealer
    keeps a few. One still referenced (queued on a socket) is never written over."""
    sealer = aead.Sealer(b"s" * 32, b"s" * 32)
    first = sealer.seal(b"aad", b"a" * 4096)
    kept = bytes(first)
    second = sealer.seal(b"aad", b"b" * 4096)
    assert second.obj is not first.obj and bytes(first) == kept  # first is still queued
    buffer = id(first.obj)
    del first
    third = sealer.seal(b"aad", b"c" * 1000)  # smaller: fits the free body
    assert id(third.obj) == buffer and third.nbytes == 1000 + aead.OVERHEAD
    assert bytes(sealer.open(b"aad", third)) == b"c" * 1000
    held = [sealer.seal(b"aad", b"d" * 64) for _ in range(2 * aead.POOL_BUFFERS)]
    assert len({id(v.obj) for v in held} | {id(second.obj), id(third.obj)}) == len(held) + 2
    assert all(bytes(sealer.open(b"aad", v)) == b"d" * 64 for v in held)

"""Trust: authentication at link time; hostile frames are rejected and counted, never a crash."""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec
import pytest
import zmq

from transfer import (
    RemoteBlocks,
    StatusCode,
    TransferEngine,
    TransferError,
    TransferState,
    wire,
)
from transfer.testing import PeerProcess, blocks_digest

from .conftest import FAST


def test_wrong_secret_fails_to_link(
    receiver: PeerProcess, make_engine: Callable[..., TransferEngine]
) -> None:
    eng = make_engine(secret="not-the-secret")
    with pytest.raises(TransferError) as info:
        eng.link(receiver.engine_id, receiver.address)
    assert info.value.code in (StatusCode.AUTH_FAILED, StatusCode.LINK_FAILED)
    assert eng.metrics().auth_failures_total >= 1
    assert eng.peers() == []


def test_push_without_link_is_not_linked(make_engine: Callable[..., TransferEngine]) -> None:
    eng = make_engine()
    h = eng.push_blocks("nobody", [1], RemoteBlocks("r", 1, (1,)))
    assert h.wait(5) is TransferState.FAILED
    assert h.error is not None and h.error.code is StatusCode.NOT_LINKED


def test_hostile_frames_are_counted_and_ignored(
    receiver: PeerProcess, make_engine: Callable[..., TransferEngine]
) -> None:
    before = receiver.counts().metrics.frames_rejected_total
    ctx = zmq.Context.instance()
    evil = ctx.socket(zmq.DEALER)
    evil.setsockopt(zmq.LINGER, 0)
    evil.connect(receiver.address)
    pack = msgspec.msgpack.encode
    frames = [
        [b"\x00garbage"],
        [pack({"v": 99, "t": "hello", "sid": b""})],
        [pack({"v": 1, "t": "exec", "sid": b""})],
        [pack({"v": 1, "t": "hello", "sid": b"", "eid": 5})],
        [
            wire.seal(
                pack(
                    {
                        "v": wire.VERSION,
                        "sid": b"x" * 16,
                        "m": {"t": "data", "x": "a", "s": 0, "ti": 0, "lo": 0, "hi": 1, "d": None},
                    }
                )
            ),
            b"\x00" * 1024,
        ],
        [wire.seal(pack({"v": wire.VERSION, "sid": b"", "m": {"t": "begin", "x": "a"}}))],
        [pack({"v": 1, "t": "hello", "sid": b""}) + b"crc!"],
        [b"a", b"b", b"c"],
    ]
    for parts in frames:
        evil.send_multipart(parts)
    # a NOT_LINKED answer proves the receiver read them; wait for it instead of sleeping
    assert evil.poll(5000)
    evil.close()
    # the engine still serves honest peers
    eng = make_engine()
    eng.link(receiver.engine_id, receiver.address)
    blocks = RemoteBlocks.from_wire(receiver.call("reserve", rid="after-evil", ids=[60, 61]))
    h = eng.push_blocks(receiver.engine_id, [1, 2], blocks, transport="tcp")
    assert h.wait(5) is TransferState.DONE
    assert receiver.call("digest", ids=[60, 61]) == blocks_digest(eng.region(), [1, 2])
    receiver.call("release", rid="after-evil")
    after = receiver.counts().metrics.frames_rejected_total
    assert after - before >= len(frames)


def test_a_hello_flood_from_elsewhere_cannot_evict_a_pending_handshake(
    make_engine: Callable[..., TransferEngine],
) -> None:
    """An unauthenticated peer that opens many connections and says HELLO on each once
    pushed a real peer's half-done handshake out of the table (256 kept, oldest out), so
    its AUTH was refused. Pending HELLOs are now bounded per source address: a flood from
    127.0.0.2 evicts only its own."""
    from transfer import auth
    from transfer.handshake import MAX_PENDING_HELLOS
    from transfer.messages import About, Auth, Challenge, Hello, Welcome

    d = make_engine()
    ctx = zmq.Context.instance()
    real = ctx.socket(zmq.DEALER)
    real.setsockopt(zmq.LINGER, 0)
    real.connect(d.address)
    nonce = auth.new_nonce()
    real.send(wire.encode(Hello(engine_id="p-real", role="prefill", nonce=nonce)))
    assert real.poll(5000)
    challenge = wire.decode(real.recv(), 1).msg
    assert isinstance(challenge, Challenge)
    port = d.address.rsplit(":", 1)[1]
    flood = []
    try:
        for i in range(MAX_PENDING_HELLOS + 50):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://127.0.0.2:0;127.0.0.1:{port}")
            s.send(wire.encode(Hello(engine_id=f"x{i}", role="prefill", nonce=auth.new_nonce())))
            flood.append(s)
        for s in flood:  # every HELLO was handled (each got its CHALLENGE)
            assert s.poll(5000)
            s.recv()
        secret = FAST["secret"].encode()
        proof = auth.client_proof(secret, nonce, challenge.nonce, "p-real", challenge.engine_id)
        about = About(host="elsewhere", pid=1, data_address="", regions=[], fingerprint="")
        real.send(wire.encode(Auth(proof=proof, about=about)))
        assert real.poll(5000)
        assert isinstance(wire.decode(real.recv(), 1).msg, Welcome)
    finally:
        for s in flood:
            s.close()
        real.close()


def test_a_connection_that_never_authenticates_gets_a_few_answers_not_one_per_frame(
    make_engine: Callable[..., TransferEngine],
) -> None:
    """Every unauthenticated frame was answered (NOT_LINKED), and a peer that never reads
    its answers grew the engine's send queue without bound (the ROUTER has no high-water
    mark, so that sessions never lose a frame). Now a connection gets a few answers until
    it authenticates; what it sends after is counted and dropped."""

    from transfer.messages import Ping

    d = make_engine()
    before = d.metrics().rejected("unauthenticated")
    ctx = zmq.Context.instance()
    evil = ctx.socket(zmq.DEALER)
    evil.setsockopt(zmq.LINGER, 0)
    evil.connect(d.address)
    try:
        for _ in range(1000):
            evil.send(wire.encode(Ping(), b"s" * 16))
        deadline = time.monotonic() + 30
        while d.metrics().rejected("unauthenticated") < before + 1000:
            assert time.monotonic() < deadline, "the frames were not all read"
            time.sleep(0.05)
        answers = 0
        while evil.poll(500):
            evil.recv()
            answers += 1
        assert 1 <= answers <= 8, answers
    finally:
        evil.close()


def test_a_hello_flood_from_one_socket_stays_bounded_and_a_real_peer_still_links(
    make_engine: Callable[..., TransferEngine],
) -> None:
    """The ROUTER's receive queue had no high-water mark: while the I/O thread was busy,
    ZMQ read whatever a connection sent into memory (256 MiB of forged HELLOs all went
    in). Now a connection's unread frames stop at the ROUTER's RCVHWM and then at the
    kernel's socket buffers: the flooder blocks, nothing piles up here. Once the thread
    runs again the flood is read, gets a few answers, and a real engine still links."""
    import threading

    from transfer import auth
    from transfer.messages import Hello

    d = make_engine()
    stalled, release = threading.Event(), threading.Event()

    def stall() -> None:
        stalled.set()
        release.wait(60)

    d._loop.call(stall)  # the I/O thread busy, as under load
    assert stalled.wait(10)
    ctx = zmq.Context.instance()
    evil = ctx.socket(zmq.DEALER)
    evil.setsockopt(zmq.LINGER, 0)
    evil.setsockopt(zmq.SNDHWM, 16)
    evil.setsockopt(zmq.SNDBUF, 64 << 10)
    evil.connect(d.address)
    # HELLOs padded to 64 KiB: the frame is read whole before anything decodes it.
    hello = wire.encode(Hello(engine_id="p-evil", role="prefill", nonce=auth.new_nonce()))
    frame = hello + b"\x00" * ((64 << 10) - len(hello))
    sent = 0
    try:
        # Until the socket stays full for a second (or 256 MiB went out).
        while sent < 4096 and evil.poll(1000, zmq.POLLOUT):
            evil.send(frame, zmq.NOBLOCK)
            sent += 1
        # Bounded: RCVHWM frames, what two socket buffers hold, the flooder's own 16.
        assert sent < 1024, f"{sent} frames of 64 KiB were taken while the engine was busy"
    finally:
        release.set()
    # The thread runs again: it drains the flood (no answer to padded frames), the socket
    # says HELLO a thousand times more, and a real engine links meanwhile.
    for _ in range(1000):
        evil.send(hello)
    eng = make_engine()
    eng.link(d.engine_id, d.address)
    assert d.engine_id in eng.peers()
    answers = 0
    while evil.poll(1000):
        evil.recv()
        answers += 1
    assert 1 <= answers <= 8, answers
    assert d.metrics().rejected("reply_budget") > 0
    evil.close()


def test_a_peer_we_dial_cannot_pile_frames_up_here_either(
    make_engine: Callable[..., TransferEngine],
) -> None:
    """The sockets we dial peers with had no receive high-water mark either: a listener at
    an address we were given (or a man in the middle there) could send frames into our
    memory faster than a busy I/O thread reads them. They stop at the same bound now."""
    import threading

    d = make_engine()
    ctx = zmq.Context.instance()
    evil = ctx.socket(zmq.ROUTER)
    evil.setsockopt(zmq.LINGER, 0)
    evil.setsockopt(zmq.ROUTER_MANDATORY, 1)
    evil.setsockopt(zmq.SNDHWM, 16)
    evil.setsockopt(zmq.SNDBUF, 64 << 10)
    port = evil.bind_to_random_port("tcp://127.0.0.1")
    attempt = d.link_async("p-evil", f"tcp://127.0.0.1:{port}")
    assert evil.poll(10_000)
    identity = evil.recv_multipart()[0]  # our HELLO: the listener now knows our socket
    stalled, release = threading.Event(), threading.Event()

    def stall() -> None:
        stalled.set()
        release.wait(60)

    d._loop.call(stall)
    assert stalled.wait(10)
    frame = b"\x00" * (64 << 10)
    sent = 0
    try:
        deadline = time.monotonic() + 1.0  # until it stays full for a second
        while sent < 4096 and time.monotonic() < deadline:
            try:
                evil.send_multipart([identity, frame], zmq.NOBLOCK)
                sent += 1
                deadline = time.monotonic() + 1.0
            except zmq.Again:
                time.sleep(0.01)
        assert sent < 1024, f"{sent} frames of 64 KiB were taken while the engine was busy"
    finally:
        release.set()
        evil.close()
    with pytest.raises(TransferError):
        attempt.result(30)  # garbage is no handshake
    eng = make_engine()
    eng.link(d.engine_id, d.address)  # the engine still links

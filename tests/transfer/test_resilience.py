"""The I/O thread never dies and the caller never blocks: bad addresses and advertisements fail
one link with a clear code, the engine lives on, and a dead thread is reported."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
import zmq

from transfer import (
    RemoteBlocks,
    StatusCode,
    TransferEngine,
    TransferError,
    TransferState,
    auth,
    wire,
)
from transfer.messages import About, AnyMessage, Auth, Challenge, Error, Hello
from transfer.testing import PeerProcess, blocks_digest

from .conftest import SECRET

SRC, DST = [1, 2, 3], [50, 51, 52]


def _push_works(eng: TransferEngine, peer: PeerProcess, rid: str) -> None:
    eng.link(peer.engine_id, peer.address)
    blocks = RemoteBlocks.from_wire(peer.call("reserve", rid=rid, ids=DST))
    h = eng.push_blocks(peer.engine_id, SRC, blocks, transport="tcp")
    assert h.wait(10) is TransferState.DONE, h.error
    assert peer.call("digest", ids=DST) == blocks_digest(eng.region(), SRC)
    peer.call("release", rid=rid)


@pytest.mark.parametrize("address", ["not-an-endpoint", "tcp://host:notaport", "tcp://:5", ""])
def test_bad_dest_address_fails_fast_and_the_engine_lives(
    receiver: PeerProcess, make_engine: Callable[..., TransferEngine], address: str
) -> None:
    eng = make_engine()
    t0 = time.monotonic()
    with pytest.raises(TransferError) as info:
        eng.link("nobody", address)
    assert time.monotonic() - t0 < 1.0
    assert info.value.code is StatusCode.PARAM_INVALID and "address" in info.value.message
    assert eng.link_async("nobody", address).exception(1.0) is not None
    assert eng.healthy()
    _push_works(eng, receiver, f"after-bad-{len(address)}")
    assert eng.healthy()


def _fake_client(address: str, da: str, fp: str = "") -> AnyMessage:
    """An authenticated peer (it knows the secret) that advertises ``da`` as its data address
    and ``fp`` as its KV fingerprint."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        nonce = auth.new_nonce()
        sock.send(wire.encode(Hello(engine_id="fake", role="prefill", nonce=nonce)))
        assert sock.poll(5000)
        challenge = wire.decode(sock.recv(), 1).msg
        assert isinstance(challenge, Challenge)
        proof = auth.client_proof(
            SECRET.encode(), nonce, challenge.nonce, "fake", challenge.engine_id
        )
        about = About(host="h", pid=1, data_address=da, regions=[], fingerprint=fp)
        sock.send(wire.encode(Auth(proof=proof, about=about)))
        assert sock.poll(5000)
        return wire.decode(sock.recv(), 1).msg
    finally:
        sock.close()


@pytest.mark.parametrize("da", ["host:notaport", "no-port", "[::1", "h:99999", "x" * 300 + ":1"])
def test_bad_advertisement_is_refused_and_the_engine_lives(
    receiver: PeerProcess, make_engine: Callable[..., TransferEngine], da: str
) -> None:
    victim = make_engine()
    before = victim.metrics().rejected("bad_field")
    reply = _fake_client(victim.address, da)
    assert isinstance(reply, Error) and reply.code == StatusCode.FRAME_INVALID.number
    assert "data address" in reply.text
    assert victim.metrics().rejected("bad_field") == before + 1
    assert victim.peers() == []
    assert victim.healthy()
    _push_works(victim, receiver, f"after-da-{len(da)}")


@pytest.mark.parametrize("fp", ["x" * 200, "a b", "\u00e9", "a\x00"])
def test_bad_fingerprint_is_refused_and_the_engine_lives(
    receiver: PeerProcess, make_engine: Callable[..., TransferEngine], fp: str
) -> None:
    victim = make_engine()
    reply = _fake_client(victim.address, "", fp)
    assert isinstance(reply, Error) and reply.code == StatusCode.FRAME_INVALID.number
    assert "fp" in reply.text
    assert victim.peers() == [] and victim.healthy()
    _push_works(victim, receiver, f"after-fp-{len(fp)}")


def test_link_never_blocks_the_caller(make_engine: Callable[..., TransferEngine]) -> None:
    """A peer that never answers: link_async and a push to its address return at once."""
    silent = zmq.Context.instance().socket(zmq.ROUTER)  # accepts, never replies
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        eng = make_engine(link_timeout_s=0.5)
        t0 = time.monotonic()
        fut = eng.link_async("mute", f"tcp://127.0.0.1:{port}")
        eng.set_peer_address("mute", f"tcp://127.0.0.1:{port}")
        h = eng.push_blocks("mute", SRC, RemoteBlocks("r", 1, tuple(DST)), timeout_s=1.5)
        assert time.monotonic() - t0 < 0.2
        with pytest.raises(TransferError) as info:
            fut.result(5)
        assert info.value.code is StatusCode.LINK_FAILED
        assert h.wait(5) in (TransferState.TIMED_OUT, TransferState.FAILED)
        assert h.error is not None and h.error.code in (StatusCode.TIMEOUT, StatusCode.LINK_FAILED)
        assert eng.healthy() and eng.held_blocks() == {}
    finally:
        silent.close()


def test_a_dead_io_thread_is_reported_not_hidden(
    make_engine: Callable[..., TransferEngine],
) -> None:
    eng = make_engine()
    recv = eng.reserve("doomed", DST)

    def die() -> None:
        raise SystemExit("simulated fatal fault on the I/O thread")

    eng._core.loop.call(die)  # nothing public can do this: that is the point of the test
    deadline = time.monotonic() + 5
    while eng.healthy():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    health = eng.health()
    assert not health.healthy and "simulated fatal fault" in str(health.error)
    assert recv.wait(5) is TransferState.FAILED
    assert recv.error is not None and recv.error.code is StatusCode.ENGINE_CLOSED
    with pytest.raises(TransferError) as info:
        eng.push_blocks("x", SRC, RemoteBlocks("r", 1, tuple(DST)))
    assert info.value.code is StatusCode.ENGINE_CLOSED


def test_a_failing_command_or_timer_does_not_kill_the_thread(
    receiver: PeerProcess, make_engine: Callable[..., TransferEngine]
) -> None:
    eng = make_engine()

    def bug() -> None:
        raise RuntimeError("a bug in one command")

    eng._core.loop.call(bug)
    eng._core.loop.call(lambda: eng._core.loop.at(0.0, bug))
    _push_works(eng, receiver, "after-bug")
    assert eng.healthy()
    assert eng.health().internal_errors >= 2

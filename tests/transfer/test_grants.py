"""Grants: a push lands only in blocks reserved for that writer, a pull reads only blocks
offered to that reader for that request and epoch; region paths travel only after mutual
authentication and are never mapped from a directory the peer merely names."""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Callable, Iterator

import pytest
import zmq

from transfer import (
    KVRegion,
    RemoteBlocks,
    StatusCode,
    TransferConfig,
    TransferEngine,
    TransferError,
    TransferState,
    check_secret,
    wire,
)
from transfer.messages import Challenge, Error, Hello, Landed
from transfer.testing import PeerProcess, blocks_digest, fill, make_config

from .conftest import FAST, REGION

SRC, DST = [1, 2, 3, 4], [40, 41, 42, 43]


@pytest.fixture
def trio() -> Iterator[tuple[TransferEngine, TransferEngine, TransferEngine]]:
    """A decode engine and two prefill engines in this process, all linked to decode."""
    cfg = make_config(FAST)
    d = TransferEngine("d-grant", "decode", cfg)
    a = TransferEngine("a-grant", "prefill", cfg)
    b = TransferEngine("b-grant", "prefill", cfg)
    try:
        d.register_region(KVRegion.allocate("kv", 4, 64, (16, 2, 8), shared=True))
        for i, eng in enumerate((a, b)):
            region = KVRegion.allocate("kv", 4, 64, (16, 2, 8))
            fill(region, 10 + i)
            eng.register_region(region)
            eng.link(d.engine_id, d.address)
        yield d, a, b
    finally:
        for eng in (a, b, d):
            eng.close()


def _rejected(eng: TransferEngine, reason: str) -> int:
    return eng.metrics().rejected(reason)


def _zeros(like: KVRegion) -> KVRegion:
    return KVRegion.allocate("z", like.num_layers, like.num_blocks, like.block_shape)


@pytest.mark.parametrize("transport", ["local", "shm", "tcp"])
def test_push_only_from_the_granted_writer(
    trio: tuple[TransferEngine, TransferEngine, TransferEngine], transport: str
) -> None:
    d, a, b = trio
    recv = d.reserve(f"w-{transport}", DST, writer=a.engine_id)
    assert recv.blocks is not None
    before = _rejected(d, "not_granted")
    evil = b.push_blocks(d.engine_id, SRC, recv.blocks, transport=transport)
    assert evil.wait(5) is TransferState.FAILED
    assert evil.error is not None and evil.error.code is StatusCode.NOT_GRANTED
    assert not evil.error.recoverable
    assert _rejected(d, "not_granted") == before + 1
    assert blocks_digest(d.region(), DST) == blocks_digest(_zeros(d.region()), DST)
    good = a.push_blocks(d.engine_id, SRC, recv.blocks, transport=transport)
    assert good.wait(5) is TransferState.DONE, good.error
    assert recv.wait(5) is TransferState.DONE
    assert blocks_digest(d.region(), DST) == blocks_digest(a.region(), SRC)
    d.release(recv.request_id)
    assert d.reserved_blocks() == {"kv": 0} and b.held_blocks() == {}


def test_pull_without_an_offer_is_refused(make_engine: Callable[..., TransferEngine]) -> None:
    """An authenticated outsider asks for the victim's block 5: refused, counted, nothing read."""
    victim = make_engine()
    outsider = make_engine()
    outsider.link(victim.engine_id, victim.address)
    recv = outsider.reserve("steal", [9])
    assert recv.blocks is not None
    before = _rejected(victim, "not_granted")
    h = outsider.pull_blocks(victim.engine_id, [5], recv.blocks)
    assert h.wait(5) is TransferState.FAILED
    assert h.error is not None and h.error.code is StatusCode.NOT_GRANTED
    assert _rejected(victim, "not_granted") == before + 1
    assert blocks_digest(outsider.region(), [9]) != blocks_digest(victim.region(), [5])
    assert victim.held_blocks() == {}
    outsider.release("steal")


def test_pull_serves_only_the_offer_to_that_reader(
    make_engine: Callable[..., TransferEngine],
) -> None:
    source, reader, other = make_engine(), make_engine(), make_engine()
    for eng in (reader, other):
        eng.link(source.engine_id, source.address)
    offer = source.offer("held-1", [5, 6], reader=reader.engine_id, layers=(1, 3))
    assert offer.kind == "offer" and offer.blocks is not None
    ticket = offer.blocks

    def pull(eng: TransferEngine, src: RemoteBlocks, rid: str) -> TransferError:
        recv = eng.reserve(rid, [20, 21])
        assert recv.blocks is not None
        h = eng.pull_blocks(source.engine_id, src, recv.blocks, layers=(1, 3))
        assert h.wait(5) is TransferState.FAILED, rid
        eng.release(rid)
        assert h.error is not None
        return h.error

    assert pull(other, ticket, "other").code is StatusCode.NOT_GRANTED  # not the reader
    stale = RemoteBlocks(ticket.request_id, ticket.epoch + 1, ticket.block_ids, ticket.region)
    assert pull(reader, stale, "stale").code is StatusCode.NOT_GRANTED  # wrong epoch
    wider = RemoteBlocks(ticket.request_id, ticket.epoch, (5, 7), ticket.region)
    assert pull(reader, wider, "wider").code is StatusCode.NOT_GRANTED  # block not offered
    recv = reader.reserve("ok", [20, 21])
    assert recv.blocks is not None
    outside = reader.pull_blocks(source.engine_id, ticket, recv.blocks, layers=(0, 2))
    assert outside.wait(5) is TransferState.FAILED  # layer 0 was not offered
    assert source.held_blocks() == {"kv": 2}  # the offer still holds blocks 5 and 6
    h = reader.pull_blocks(source.engine_id, ticket, recv.blocks, layers=(1, 3))
    assert h.wait(5) is TransferState.DONE, h.error
    assert blocks_digest(reader.region(), [20, 21], (1, 3)) == blocks_digest(
        source.region(), [5, 6], (1, 3)
    )
    assert offer.wait(5) is TransferState.DONE  # every offered layer was served and ACKed
    source.progress()
    assert source.held_blocks() == {}
    again = reader.pull_blocks(source.engine_id, ticket, recv.blocks, layers=(1, 3))
    assert again.wait(5) is TransferState.FAILED  # a served offer is spent
    reader.release("ok")


def test_offer_lease_expires_and_withdraw_ends_it(
    make_engine: Callable[..., TransferEngine],
) -> None:
    source, reader = make_engine(), make_engine()
    reader.link(source.engine_id, source.address)
    lapsed = source.offer("lapse", [5], reader=reader.engine_id, lease_s=0.3)
    assert lapsed.wait(5) is TransferState.TIMED_OUT
    assert lapsed.error is not None and lapsed.error.code is StatusCode.LEASE_EXPIRED
    withdrawn = source.offer("gone", [6], reader=reader.engine_id)
    source.withdraw("gone")
    assert withdrawn.wait(5) is TransferState.CANCELLED
    for ticket in (lapsed.blocks, withdrawn.blocks):
        assert ticket is not None
        recv = reader.reserve(f"late-{ticket.request_id}", [30])
        assert recv.blocks is not None
        h = reader.pull_blocks(source.engine_id, ticket, recv.blocks)
        assert h.wait(5) is TransferState.FAILED
        assert h.error is not None and h.error.code is StatusCode.NOT_GRANTED
        reader.release(recv.request_id)
    assert source.held_blocks() == {}


def _hello_reply(address: str) -> bytes:
    """Speak the first step of the handshake as an unauthenticated stranger."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        sock.send(wire.encode(Hello(engine_id="stranger", role="both", nonce=b"n" * 16)))
        assert sock.poll(5000), "no answer to hello"
        return bytes(sock.recv())
    finally:
        sock.close()


def test_region_paths_only_after_authentication(
    make_engine: Callable[..., TransferEngine],
) -> None:
    eng = make_engine()
    eng.register_region(KVRegion.allocate("kv2", 1, 4, (16, 2, 8), shared=True))
    reply = _hello_reply(eng.address)
    assert isinstance(wire.decode(reply, 1).msg, Challenge)
    assert b"/dev/shm" not in reply and b"hetero_pd-" not in reply and b"kv2" not in reply


def test_foreign_shm_paths_are_never_mapped(make_engine: Callable[..., TransferEngine]) -> None:
    """A peer that names a bystander's /dev/shm files gets nothing written there."""
    with PeerProcess("bystander", make_config(FAST), REGION) as bystander:
        (root,) = glob.glob(f"/dev/shm/hetero_pd-{bystander.process.pid}-*")
        paths = sorted(glob.glob(os.path.join(root, "kv.*")), key=lambda p: int(p.rsplit(".")[-1]))
        before = bystander.call("digest", ids=DST)
        liar = TransferEngine("liar", "decode", make_config(FAST))
        try:
            like = KVRegion.allocate("kv", 4, 64, (16, 2, 8))
            liar.register_region(KVRegion("kv", like.tensors, shm_paths=paths))
            victim = make_engine()
            victim.link(liar.engine_id, liar.address)
            recv = liar.reserve("lure", DST)
            assert recv.blocks is not None
            h = victim.push_blocks(liar.engine_id, SRC, recv.blocks, transport="shm")
            h.wait(5)
            assert h.state is not TransferState.DONE
            assert bystander.call("digest", ids=DST) == before
            assert bystander.counts().metrics.transports == {}
        finally:
            liar.close(close_regions=False)


def test_empty_secret_refused_off_loopback() -> None:
    check_secret("127.0.0.1", b"")
    check_secret("localhost", b"")
    check_secret("::1", b"")
    check_secret("0.0.0.0", b"secret")
    for host in ("0.0.0.0", "10.1.2.3", "decode-0.svc", "::"):
        with pytest.raises(TransferError) as info:
            check_secret(host, b"")
        assert info.value.code is StatusCode.PARAM_INVALID and host in info.value.message
    required = TransferConfig(host="0.0.0.0", require_secret=True)  # loads without its secret
    with pytest.raises(TransferError) as info:
        TransferEngine("open", "decode", required)
    assert info.value.code is StatusCode.PARAM_INVALID
    TransferEngine(
        "closed", "decode", TransferConfig(host="0.0.0.0", secret=b"k", require_secret=True)
    ).close()


def _say_landed(
    eng: TransferEngine,
    peer: str,
    transfer_id: str,
    seqs: list[int],
    ds: list[int],
    wv: bool = False,
    grant: int = 1,
) -> None:
    """Send a raw LANDED from ``eng`` to ``peer`` (what a hostile linked engine could send);
    ``wv``: claim the chunks were verified by their writer."""
    core = eng._core  # nothing public sends a bare LANDED: that is the point of the test

    def send() -> None:
        session = core.linker.session_for(peer)
        assert session is not None
        landed = Landed(
            transfer_id=transfer_id, seqs=seqs, digests=ds, writer_verified=wv, grant=grant
        )
        core.outbox.post(session, landed)

    core.loop.call_wait(send, 5)


def _wait_rejected(eng: TransferEngine, reason: str, count: int) -> None:
    deadline = time.monotonic() + 10
    while _rejected(eng, reason) < count:
        assert time.monotonic() < deadline, eng.metrics().frames_rejected
        time.sleep(0.01)


def test_landed_claims_count_only_from_the_writer(
    make_engine: Callable[..., TransferEngine],
) -> None:
    """Direct chunks are verified as their writer says they landed; another peer's claims
    about the transfer, and malformed ones, are rejected and change no verdict."""
    d = make_engine(shared=True)
    slow_end = [{"kind": "delay", "msg_type": "end", "nth": 1, "delay_s": 2.0}]
    a, b = make_engine(faults=slow_end, ack_timeout_s=6.0), make_engine()
    for eng in (a, b):
        eng.link(d.engine_id, d.address)
    recv = d.reserve("landed", DST, writer=a.engine_id)
    assert recv.blocks is not None
    h = a.push_blocks(d.engine_id, SRC, recv.blocks, transport="shm")
    _say_landed(a, d.engine_id, h.transfer_id, [0, 1], [1])  # ds shorter than s
    _say_landed(a, d.engine_id, h.transfer_id, [10**6], [1])  # no such chunk
    _say_landed(a, d.engine_id, h.transfer_id, [0], [1])  # well formed, not END's digest
    _say_landed(a, d.engine_id, h.transfer_id, [1], [1], wv=True)  # "verified", wrong digest
    _wait_rejected(d, "bad_field", 2)  # so the transfer is open at d (END is held back)
    before = _rejected(d, "not_granted")
    _say_landed(b, d.engine_id, h.transfer_id, [0], [12345])
    _say_landed(b, d.engine_id, h.transfer_id, [1], [12345], wv=True)
    _wait_rejected(d, "not_granted", before + 2)
    assert h.wait(10) is TransferState.DONE, h.error
    assert h.attempts == 1  # the false claim changed no verdict
    assert recv.wait(5) is TransferState.DONE
    assert blocks_digest(d.region(), DST) == blocks_digest(a.region(), SRC)
    d.release(recv.request_id)


def test_a_verified_claim_with_the_wrong_digest_vouches_for_nothing(
    make_engine: Callable[..., TransferEngine],
) -> None:
    """The writer skipped chunk 0's copy (a drop fault) and then claims it verified it, with
    a digest that is not END's: the receiver reads the chunk back, NACKs it, and the retry
    lands the right bytes."""
    d = make_engine(shared=True)
    faults = [
        {"kind": "drop", "msg_type": "direct", "nth": 1},
        {"kind": "delay", "msg_type": "end", "nth": 1, "delay_s": 1.0},
    ]
    a = make_engine(faults=faults, ack_timeout_s=6.0)
    a.link(d.engine_id, d.address)
    recv = d.reserve("claim", DST, writer=a.engine_id)
    assert recv.blocks is not None
    h = a.push_blocks(d.engine_id, SRC, recv.blocks, transport="shm")
    deadline = time.monotonic() + 10
    while not d.metrics().transport("shm").chunks_read_back_total:
        assert time.monotonic() < deadline, "the writer's own LANDED never came"
        time.sleep(0.01)  # d read chunk 0 back on the writer's LANDED: now the claim
    _say_landed(a, d.engine_id, h.transfer_id, [0], [1], wv=True)
    assert h.wait(10) is TransferState.DONE, h.error
    assert h.attempts == 2  # chunk 0 was NACKed, whatever the claim said
    assert blocks_digest(d.region(), DST) == blocks_digest(a.region(), SRC)
    d.release("claim")


def test_a_pull_the_source_cannot_serve_fails_at_once_not_at_its_deadline(
    make_engine: Callable[..., TransferEngine],
) -> None:
    """Every data frame the source sends is corrupted: its push fails its checksums on every
    attempt and the source gives up. The puller is told (NOT_SERVED, final) instead of
    resending its PULL, which started the same doomed push again, until its own deadline."""
    corrupt = [{"kind": "corrupt", "msg_type": "data", "nth": 1, "count": 10**6}]
    source = make_engine(transports=["tcp"], faults=corrupt, retry={"attempts": 2})
    reader = make_engine(transports=["tcp"])
    reader.link(source.engine_id, source.address)
    offer = source.offer("doomed", [5, 6], reader=reader.engine_id)
    assert offer.blocks is not None
    recv = reader.reserve("doomed-dst", [20, 21])
    assert recv.blocks is not None
    h = reader.pull_blocks(source.engine_id, offer.blocks, recv.blocks, timeout_s=120.0)
    assert h.wait(20) is TransferState.FAILED, h.error  # not TIMED_OUT at 120 s
    assert h.error is not None and h.error.code is StatusCode.NOT_SERVED, h.error
    assert "checksum" in str(h.error).lower(), h.error  # the source's reason travels along
    assert offer.wait(20) is TransferState.FAILED  # the offer ended: its blocks are free
    source.progress()
    assert source.held_blocks() == {}
    reader.release("doomed-dst")


def test_only_the_pulls_source_can_end_it(make_engine: Callable[..., TransferEngine]) -> None:
    """Another authenticated peer names our pull in a final ERROR (NOT_SERVED) while the
    source is still about to serve it: it is not the pull's source, so the pull goes on and
    is served."""
    slow = [{"kind": "delay", "msg_type": "begin", "nth": 1, "count": 1, "delay_s": 1.0}]
    source, reader, meddler = make_engine(faults=slow), make_engine(), make_engine()
    reader.link(source.engine_id, source.address)
    meddler.link(reader.engine_id, reader.address)
    offer = source.offer("held", [5, 6], reader=reader.engine_id)
    recv = reader.reserve("held-dst", [20, 21])
    assert offer.blocks is not None and recv.blocks is not None
    h = reader.pull_blocks(source.engine_id, offer.blocks, recv.blocks)
    core = meddler._core  # a peer that knows the secret but is not the source
    lie = Error.of(h.transfer_id, TransferError(StatusCode.NOT_SERVED, "forged"))

    def forge() -> None:
        session = core.linker.session_for(reader.engine_id)
        assert session is not None
        core.outbox.post(session, lie)

    core.loop.call_wait(forge, 5)
    assert h.wait(10) is TransferState.DONE, h.error  # the source's BEGIN came 1 s later
    reader.release("held-dst")

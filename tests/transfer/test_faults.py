"""Injected faults on every transport: identical bytes or the right error, in time, nothing
leaked. The matrix runs in one process (all four data paths); the tests below it use real
processes (a mute or lossy receiver); peers killed mid-transfer are in test_ownership."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from transfer import RemoteBlocks, TransferEngine, TransferState
from transfer.testing import PeerProcess, blocks_digest, make_config

from .conftest import FAST, REGION

SRC = [2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
DST = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]

#: transport -> (forced transport, sender config, the message type its data moves as)
TRANSPORTS = {
    "local": ("local", {}, "direct"),
    "shm": ("shm", {}, "direct"),
    "tcp": ("tcp", {}, "data"),  # the data channel
    "tcp-link": ("tcp", {"data_channel": False}, "data"),  # chunks as ZMQ frames
    # sealed (transfer.aead): chunks sealed ahead and opened on the hashing threads
    "tcp-sealed": ("tcp", {"encrypt": "on"}, "data"),
    "tcp-link-sealed": ("tcp", {"data_channel": False, "encrypt": "on"}, "data"),
}
KINDS = ("drop", "delay", "duplicate", "reorder", "corrupt", "disconnect")
#: Faults on control frames (nth=1), for every transport.
CONTROL = (
    ("drop", "begin"),
    ("drop", "end"),
    ("duplicate", "end"),
    ("corrupt", "begin"),
    ("reorder", "begin"),
    ("delay", "end"),
)
MATRIX = [(t, k, TRANSPORTS[t][2], 2) for t in TRANSPORTS for k in KINDS] + [
    (t, k, m, 1) for t in TRANSPORTS for k, m in CONTROL
]


@pytest.mark.parametrize(("transport", "kind", "msg_type", "nth"), MATRIX)
def test_fault_matrix_recovers_exactly(
    make_pair: Callable[..., tuple[TransferEngine, TransferEngine]],
    transport: str,
    kind: str,
    msg_type: str,
    nth: int,
) -> None:
    """One fault of every kind on every transport: identical bytes, in time, nothing leaked."""
    forced, sender, _ = TRANSPORTS[transport]
    rule = {"kind": kind, "msg_type": msg_type, "nth": nth, "delay_s": 0.2}
    p, d = make_pair(sender={**sender, "faults": [rule]})
    recv = d.reserve("matrix", DST, writer=p.engine_id)
    assert recv.blocks is not None
    t0 = time.monotonic()
    h = p.push_blocks(d.engine_id, SRC, recv.blocks, transport=forced, timeout_s=8)
    assert h.wait(10) is TransferState.DONE, h.error
    assert time.monotonic() - t0 < 8
    assert recv.wait(5) is TransferState.DONE
    assert blocks_digest(d.region(), DST) == blocks_digest(p.region(), SRC)
    assert p.metrics().faults_injected_total >= 1
    d.release("matrix")
    d.check_integrity()
    assert d.reserved_blocks() == {"kv": 0}
    assert p.held_blocks() == {}
    assert p.healthy() and d.healthy()


def test_corruption_without_retries_fails_loudly(
    receiver: PeerProcess, make_engine: Callable[..., TransferEngine]
) -> None:
    eng = make_engine(
        faults=[{"kind": "corrupt", "msg_type": "data", "nth": 1, "count": 100}],
        retry={"attempts": 2, "base_delay_s": 0.01, "max_delay_s": 0.01},
    )
    eng.link(receiver.engine_id, receiver.address)
    blocks = RemoteBlocks.from_wire(receiver.call("reserve", rid="corrupt-all", ids=DST))
    h = eng.push_blocks(receiver.engine_id, SRC, blocks, transport="tcp")
    assert h.wait(10) is TransferState.FAILED
    assert h.error is not None and h.error.code.name == "CHECKSUM_MISMATCH"
    assert receiver.wait("corrupt-all", 0.01).state == "pending"
    counts = receiver.counts()
    assert counts.metrics.transport("tcp").checksum_failures_total >= 1
    receiver.call("release", rid="corrupt-all")


def test_lost_ack_is_retried_and_never_applied_twice(
    make_engine: Callable[..., TransferEngine],
) -> None:
    """The receiver's first ACK is dropped: the sender re-links, resends BEGIN, gets dup ACK."""
    faults = {**FAST, "faults": [{"kind": "drop", "msg_type": "ack", "nth": 1}]}
    with PeerProcess("decode-lossy", make_config(faults), REGION) as peer:
        eng = make_engine()
        eng.link(peer.engine_id, peer.address)
        blocks = RemoteBlocks.from_wire(peer.call("reserve", rid="ack-lost", ids=DST))
        h = eng.push_blocks(peer.engine_id, SRC, blocks, transport="tcp")
        assert h.wait(10) is TransferState.DONE, h.error
        assert h.attempts >= 2
        counts = peer.counts()
        assert counts.metrics.transport("tcp").duplicates_total >= 1
        assert peer.call("digest", ids=DST) == blocks_digest(eng.region(), SRC)


def test_lease_expires_when_acks_never_come(make_engine: Callable[..., TransferEngine]) -> None:
    faults = {**FAST, "faults": [{"kind": "drop", "msg_type": "ack", "nth": 1, "count": 1000}]}
    with PeerProcess("decode-mute", make_config(faults), REGION) as peer:
        eng = make_engine()
        eng.link(peer.engine_id, peer.address)
        blocks = RemoteBlocks.from_wire(peer.call("reserve", rid="lease", ids=DST))
        t0 = time.monotonic()
        h = eng.push_blocks(peer.engine_id, SRC, blocks, transport="tcp", lease_s=1.5, timeout_s=6)
        assert h.wait(5) is TransferState.TIMED_OUT
        assert 1.4 < time.monotonic() - t0 < 4
        assert h.error is not None and h.error.code.name == "LEASE_EXPIRED"
        assert h.released == "lease_expired"
        assert eng.metrics().transport("tcp").lease_expiries_total == 1
        assert eng.held_blocks() == {}

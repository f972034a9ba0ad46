"""Injected faults between two processes: identical bytes or the right error, in time."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from transfer import RemoteBlocks, TransferEngine, TransferState
from transfer.testing import PeerProcess, blocks_digest

from .conftest import FAST, REGION

SRC = [2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
DST = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]

RECOVERED = [
    ("drop", "data", 3),
    ("delay", "data", 2),
    ("duplicate", "data", 2),
    ("reorder", "data", 2),
    ("corrupt", "data", 3),
    ("disconnect", "data", 4),
    ("drop", "begin", 1),
    ("drop", "end", 1),
    ("corrupt", "begin", 1),
    ("duplicate", "end", 1),
    ("reorder", "begin", 1),
]


@pytest.mark.parametrize(("kind", "msg_type", "nth"), RECOVERED)
def test_tcp_fault_recovers(
    receiver: PeerProcess,
    make_engine: Callable[..., TransferEngine],
    kind: str,
    msg_type: str,
    nth: int,
) -> None:
    rule = {"kind": kind, "msg_type": msg_type, "nth": nth, "delay_s": 0.2}
    eng = make_engine(faults=[rule])
    eng.link(receiver.engine_id, receiver.address)
    rid = f"fault-{kind}-{msg_type}"
    blocks = RemoteBlocks.from_wire(receiver.call("reserve", rid=rid, ids=DST))
    t0 = time.monotonic()
    h = eng.push_blocks(receiver.engine_id, SRC, blocks, transport="tcp", timeout_s=8)
    assert h.wait(10) is TransferState.DONE, h.error
    assert time.monotonic() - t0 < 8
    assert receiver.call("digest", ids=DST) == blocks_digest(eng.region(), SRC)
    assert eng.metrics()["faults_injected_total"] >= 1
    receiver.call("release", rid=rid)
    assert receiver.call("counts")["reserved"] == 0
    assert eng.held_blocks() == {}


@pytest.mark.parametrize(
    ("kind", "msg_type"),
    [("drop", "end"), ("disconnect", "end"), ("drop", "begin"), ("delay", "end")],
)
def test_shm_fault_recovers(
    receiver: PeerProcess, make_engine: Callable[..., TransferEngine], kind: str, msg_type: str
) -> None:
    eng = make_engine(faults=[{"kind": kind, "msg_type": msg_type, "nth": 1, "delay_s": 0.2}])
    eng.link(receiver.engine_id, receiver.address)
    rid = f"shm-{kind}-{msg_type}"
    blocks = RemoteBlocks.from_wire(receiver.call("reserve", rid=rid, ids=DST))
    h = eng.push_blocks(receiver.engine_id, SRC, blocks, transport="shm", checksum=True)
    assert h.wait(10) is TransferState.DONE, h.error
    assert receiver.call("digest", ids=DST) == blocks_digest(eng.region(), SRC)
    receiver.call("release", rid=rid)


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
    assert receiver.call("wait", rid="corrupt-all", timeout=0.01)["state"] == "pending"
    counts = receiver.call("counts")
    assert counts["metrics"]["transports"]["tcp"]["checksum_failures_total"] >= 1
    receiver.call("release", rid="corrupt-all")


def test_lost_ack_is_retried_and_never_applied_twice(
    make_engine: Callable[..., TransferEngine],
) -> None:
    """The receiver's first ACK is dropped: the sender re-links, resends BEGIN, gets dup ACK."""
    faults = {**FAST, "faults": [{"kind": "drop", "msg_type": "ack", "nth": 1}]}
    with PeerProcess("decode-lossy", faults, REGION) as peer:
        eng = make_engine()
        eng.link(peer.engine_id, peer.address)
        blocks = RemoteBlocks.from_wire(peer.call("reserve", rid="ack-lost", ids=DST))
        h = eng.push_blocks(peer.engine_id, SRC, blocks, transport="tcp")
        assert h.wait(10) is TransferState.DONE, h.error
        assert h.attempts >= 2
        counts = peer.call("counts")
        assert counts["metrics"]["transports"]["tcp"]["duplicates_total"] >= 1
        assert peer.call("digest", ids=DST) == blocks_digest(eng.region(), SRC)


def test_lease_expires_when_acks_never_come(make_engine: Callable[..., TransferEngine]) -> None:
    faults = {**FAST, "faults": [{"kind": "drop", "msg_type": "ack", "nth": 1, "count": 1000}]}
    with PeerProcess("decode-mute", faults, REGION) as peer:
        eng = make_engine()
        eng.link(peer.engine_id, peer.address)
        blocks = RemoteBlocks.from_wire(peer.call("reserve", rid="lease", ids=DST))
        t0 = time.monotonic()
        h = eng.push_blocks(peer.engine_id, SRC, blocks, transport="tcp", lease_s=1.5, timeout_s=6)
        assert h.wait(5) is TransferState.TIMED_OUT
        assert 1.4 < time.monotonic() - t0 < 4
        assert h.error is not None and h.error.code.name == "LEASE_EXPIRED"
        assert h.released == "lease_expired"
        assert eng.metrics()["transports"]["tcp"]["lease_expiries_total"] == 1
        assert eng.held_blocks() == {}

"""Trust: authentication at link time; hostile frames are rejected and counted, never a crash."""

from __future__ import annotations

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

"""A frame captured on the wire and sent again in the same session is refused (``replay``):
the MAC and the AEAD tag say who made a frame, not when, so each direction numbers its
frames (a MAC'd header's ``n``, a sealed chunk's nonce) and the receiver takes each number
once (transfer.replay)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from transfer import TransferEngine, TransferState
from transfer.replay import WINDOW, Window
from transfer.testing import blocks_digest

from .conftest import Pair, push_tcp

SRC, DST = [1, 2, 3], [20, 21, 22]


def _capture(engine: TransferEngine, msg_type: str) -> Callable[[], Any]:
    """Records the first ``msg_type`` frame ``engine`` sends, as its bytes left; returns a
    function that sends those bytes again on the same session, as someone on the path would."""
    outbox = engine._core.outbox  # the wire, as someone on the path sees it
    send, seen = outbox.send, []

    def recording(session: Any, kind: str, header: bytes, payload: Any = None, **kw: Any) -> Any:
        if kind == msg_type and not seen:
            copy = None if payload is None else bytes(payload)
            kw = {k: v for k, v in kw.items() if k in ("via_data",)}
            seen.append((session, kind, bytes(header), copy, kw))
        return send(session, kind, header, payload, **kw)

    outbox.send = recording  # type: ignore[method-assign]

    def replay() -> Any:
        assert seen, f"no {msg_type} frame was sent"
        session, kind, header, payload, kw = seen[0]
        return outbox.loop.call_wait(lambda: send(session, kind, header, payload, **kw), 5)

    return replay


def _wait_rejected(engine: TransferEngine, reason: str, count: int) -> None:
    deadline = time.monotonic() + 5
    while engine.metrics().rejected(reason) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.metrics().rejected(reason) == count, engine.metrics().frames_rejected


@pytest.mark.parametrize("data_channel", [True, False], ids=["data-channel", "link"])
@pytest.mark.parametrize(("msg_type", "by"), [("end", 0), ("ack", 1)])
def test_a_replayed_control_frame_is_refused(
    make_pair: Callable[..., Pair], data_channel: bool, msg_type: str, by: int
) -> None:
    """Once, a replayed END or ACK passed its MAC and was taken as a duplicate (a replayed
    RENEW kept a lease alive, a replayed PULL pushed again)."""
    spec = {"transports": ["tcp"], "data_channel": data_channel, "encrypt": "on"}
    pair = make_pair(spec, spec)
    replay = _capture(pair[by], msg_type)
    push_tcp(*pair, "first", SRC, DST)
    replay()
    _wait_rejected(pair[1 - by], "replay", 1)
    push_tcp(*pair, "second", SRC, DST)  # the session goes on
    assert pair[1 - by].metrics().rejected("replay") == 1


@pytest.mark.parametrize("data_channel", [True, False], ids=["data-channel", "link"])
def test_a_replayed_sealed_chunk_is_refused(
    make_pair: Callable[..., Pair], data_channel: bool
) -> None:
    """Chunk 1 sent twice, byte for byte (the sealed body and its header as they left): the
    second copy is a replay, refused before it is opened into the blocks."""
    duplicate = [{"kind": "duplicate", "msg_type": "data", "nth": 1}]
    spec = {"transports": ["tcp"], "data_channel": data_channel, "encrypt": "on"}
    p, d = make_pair({**spec, "faults": duplicate}, spec)
    recv = d.reserve("dup", DST)
    assert recv.blocks is not None
    h = p.push_blocks(d.engine_id, SRC, recv.blocks, transport="tcp")
    assert h.wait(10) is TransferState.DONE, h.error
    assert blocks_digest(d.region(), DST) == blocks_digest(p.region(), SRC)
    assert p.metrics().faults_injected_total == 1
    _wait_rejected(d, "replay", 1)


def test_the_window_takes_each_number_once_and_lets_frames_overtake() -> None:
    window = Window()
    assert not window.take(0)  # 0: not numbered
    assert [window.take(n) for n in (1, 3, 2, 3, 1)] == [True, True, True, False, False]
    assert window.take(WINDOW + 3)  # far ahead: 3 is now exactly WINDOW behind
    assert not window.fresh(3) and window.fresh(4) and window.take(4) and not window.take(4)
    assert window.take(10 * WINDOW) and not window.take(10 * WINDOW)

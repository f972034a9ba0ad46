"""Control frames carry a MAC under their session's keys (transfer.wire): BEGIN, END, ACK and
every other frame after the handshake. One bit flipped in a field with the header's CRC32
recomputed (what anyone on the path can do: the CRC is no secret) passes the CRC and the
typed decoder but not the MAC; the frame is dropped (``bad_mac``) and the transfer retries
instead of believing it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import pytest

from transfer import auth, wire
from transfer.messages import Ack, End, Header
from transfer.transports.tcp import frames

from .conftest import Pair, push_tcp

SRC, DST = [1, 2, 3], [20, 21, 22]
KEY = b"k" * 32


def _flipped(raw: bytes, change: Callable[[Any], Any]) -> bytes:
    """``raw`` with ``change`` applied to its message, its MAC kept, its CRC recomputed."""
    header = wire.decode(memoryview(raw), 1)
    packed = msgspec.msgpack.encode(Header(v=header.v, sid=header.sid, msg=change(header.msg)))
    return wire.seal(packed, wire.tag_of(raw))


def test_a_flipped_bit_passes_the_crc_but_not_the_mac() -> None:
    ack = Ack(transfer_id="x-1", code=0, text="", bad=[], duplicate=False)
    raw = wire.encode(ack, b"t" * 16, KEY)
    assert wire.authentic(raw, KEY)
    tampered = _flipped(raw, lambda m: msgspec.structs.replace(m, code=m.code ^ 4))
    assert wire.decode(tampered, 1).msg.code == 4  # the CRC and the decoder accept it
    assert not wire.authentic(tampered, KEY)
    assert not wire.authentic(wire.encode(ack, b"t" * 16, b"x" * 32), KEY)  # another key
    assert not wire.authentic(wire.encode(ack, b"t" * 16), KEY)  # no key at all


def test_control_keys_differ_per_direction_and_from_the_kv_keys() -> None:
    args = (b"secret", b"c" * 16, b"s" * 16, "p", "d")
    c2s, s2c = auth.control_keys(*args)
    assert c2s != s2c and not {c2s, s2c} & set(auth.session_keys(*args))
    assert auth.control_keys(b"other", *args[1:]) != (c2s, s2c)


def _tamper(p: Pair, engine: int, msg_type: str, change: Callable[[Any], Any]) -> list[int]:
    """Rewrites the first ``msg_type`` frame engine ``engine`` of the pair sends; returns a
    list that counts the rewrites."""
    outbox = p[engine]._core.outbox  # the wire, as someone on the path rewrites it
    send, done = outbox.send, []

    def rewritten(session: Any, kind: str, header: bytes, payload: Any = None, **kw: Any) -> Any:
        if kind != msg_type or done:
            return send(session, kind, header, payload, **kw)
        done.append(1)
        if kw.get("via_data"):  # the message is the data channel frame's body
            raw = _flipped(bytes(payload), change)
            stream = frames.unpack(header, 1 << 20).stream
            return send(session, kind, frames.message(stream, raw), raw, **kw)
        return send(session, kind, _flipped(header, change), payload, **kw)

    outbox.send = rewritten  # type: ignore[method-assign]
    return done


@pytest.mark.parametrize("encrypt", ["on", "off"])
def test_an_ack_altered_on_the_way_is_dropped_and_the_transfer_retried(
    make_pair: Callable[..., Pair], encrypt: str
) -> None:
    """ACK ok -> code 4 (KV_CACHE_NOT_EXIST, not recoverable): believed, it would fail the
    transfer. Dropped, the sender's ACK wait runs out, it asks again and gets a dup ACK."""
    spec = {"encrypt": encrypt, "transports": ["tcp"]}
    pair = make_pair(spec, spec)
    done = _tamper(pair, 1, "ack", lambda m: msgspec.structs.replace(m, code=m.code ^ 4))
    push_tcp(*pair, "acked", SRC, DST)
    assert done and pair[0].metrics().rejected("bad_mac") == 1


@pytest.mark.parametrize("data_channel", [True, False], ids=["data-channel", "link"])
def test_an_end_altered_on_the_way_is_dropped_and_the_transfer_retried(
    make_pair: Callable[..., Pair], data_channel: bool
) -> None:
    spec = {"transports": ["tcp"], "data_channel": data_channel}
    pair = make_pair(spec, spec)
    change: Callable[[End], End] = lambda m: msgspec.structs.replace(m, num_chunks=m.num_chunks ^ 1)  # noqa: E731
    done = _tamper(pair, 0, "end", change)
    push_tcp(*pair, "ended", SRC, DST)
    assert done and pair[1].metrics().rejected("bad_mac") == 1

"""The typed wire: every message round-trips; every kind of bad header is refused with its
reason before any handler sees it."""

from __future__ import annotations

import typing
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq

from transfer import Role, TransferConfig, TransferEngine, kv_layouts, messages, wire
from transfer.messages import (
    About,
    Ack,
    AnyMessage,
    Auth,
    Begin,
    Bye,
    Challenge,
    Data,
    End,
    Error,
    Grant,
    Hello,
    Landed,
    Ping,
    Pull,
    RegionInfo,
    Regions,
    Renew,
    Welcome,
)
from transfer.transports import DIRECT

REGION = RegionInfo(
    name="kv",
    num_layers=2,
    tensors_per_layer=2,
    num_blocks=8,
    block_shape=[16, 2, 8],
    dtype="float16",
    device="cpu",
    shm="0123abcd",
    layout="nd",
)
ABOUT = About(host="h/boot", pid=7, data_address="h:1", regions=[REGION], fingerprint="fp-1")
BEGIN = Begin(
    transfer_id="p/r/0-2/1",
    request_id="r",
    epoch=(5 << 31) | 3,
    region="kv",
    dst=[3, 4],
    num_src=2,
    dtype="float16",
    block_size=16,
    tensors_per_layer=2,
    block_shape=[16, 2, 8],
    layers=(0, 2),
    num_tokens=20,
    num_chunks=4,
    blocks_per_chunk=2,
    checksum="xxh3",
    mode="tcp",
    codec="none",
    layout="nd",
)
SAMPLES: list[AnyMessage] = [
    Hello(engine_id="p", role="prefill", nonce=b"n" * 16),
    Challenge(engine_id="d", role="decode", nonce=b"m" * 16, proof=b"p" * 32),
    Auth(proof=b"p" * 32, about=ABOUT),
    Welcome(token=b"t" * 16, about=ABOUT),
    Regions(regions=[REGION, msgspec.structs.replace(REGION, name="kv2", shm=None)]),
    Bye(),
    Ping(),
    BEGIN,
    Grant(transfer_id="x", ttl=10.0, until=12345.5, grant=2),
    Renew(request_id="r", epoch=9),
    Data(transfer_id="x", seq=3, tensor=1, lo=2, hi=4, digest=2**64 - 1),
    Landed(transfer_id="x", seqs=[0, 1], digests=[5, 6], writer_verified=True, grant=1),
    End(transfer_id="x", num_chunks=4, digests=None),
    Ack(transfer_id="x", code=0, text="", bad=[1], duplicate=True),
    Error(transfer_id="", code=7, text="not linked"),
    Pull(
        transfer_id="x",
        request_id="r",
        epoch=1,
        region="kv",
        dst=[1],
        src_region="kv",
        src=[2],
        offer_request="o",
        offer_epoch=3,
        layers=None,
        num_tokens=None,
        ttl=5.0,
    ),
]


def test_every_message_type_round_trips() -> None:
    assert {type(m) for m in SAMPLES} == set(typing.get_args(AnyMessage))
    for msg in SAMPLES:
        parts = 2 if isinstance(msg, Data) else 1
        header = wire.decode(wire.encode(msg, b"s" * 16), parts)
        assert header.msg == msg and header.sid == b"s" * 16 and header.v == wire.VERSION
        assert messages.tag(msg) == type(msg).__name__.lower()  # the fault rules' names


def test_literals_follow_the_code_they_mirror() -> None:
    assert typing.get_args(messages.Layout) == kv_layouts.LAYOUTS
    assert set(typing.get_args(messages.RoleName)) == {role.value for role in Role}
    assert set(typing.get_args(messages.Transport)) == {"tcp", *DIRECT}


def _sent(msg: AnyMessage) -> dict[str, Any]:
    """``msg`` as the plain map the wire carries (field names as sent, with its tag)."""
    out: dict[str, Any] = msgspec.to_builtins(msg)
    return out


def _forge(body: Any, v: Any = wire.VERSION, sid: Any = b"s" * 16, **header: Any) -> bytes:
    return wire.seal(msgspec.msgpack.encode({"v": v, "sid": sid, "m": body, **header}))


GOOD_BEGIN = _sent(BEGIN)
BAD_FRAMES = {
    "wrong type": (_forge({**GOOD_BEGIN, "nsrc": "2"}), "bad_field"),
    "bool for an int": (_forge({**GOOD_BEGIN, "ep": True}), "bad_field"),
    "int for a bool": (_forge({**_sent(SAMPLES[11]), "wv": 1}), "bad_field"),
    "unknown tag": (_forge({**GOOD_BEGIN, "t": "exec"}), "unknown_type"),
    "no tag": (_forge({k: v for k, v in GOOD_BEGIN.items() if k != "t"}), "unknown_type"),
    "negative block id": (_forge({**GOOD_BEGIN, "dst": [3, -4]}), "bad_field"),
    "block id past 2**31": (_forge({**GOOD_BEGIN, "dst": [2**31]}), "bad_field"),
    "three layer bounds": (_forge({**GOOD_BEGIN, "lay": [0, 1, 2]}), "bad_field"),
    "unknown transport": (_forge({**GOOD_BEGIN, "mode": "rdma"}), "bad_field"),
    "long request id": (_forge({**GOOD_BEGIN, "rid": "r" * 1025}), "bad_field"),
    "nine dimensions": (_forge({**GOOD_BEGIN, "shape": [1] * 9}), "bad_field"),
    "NaN grant": (_forge({**_sent(SAMPLES[8]), "until": float("nan")}), "bad_field"),
    "missing field": (
        _forge({k: v for k, v in GOOD_BEGIN.items() if k != "ck"}),
        "bad_field",
    ),
    "extra field": (_forge({**GOOD_BEGIN, "exec": "rm -rf /"}), "bad_field"),
    "extra header field": (_forge(GOOD_BEGIN, extra=1), "malformed"),
    "65 regions": (_forge({"t": "regions", "regions": [_sent(REGION)] * 65}), "bad_field"),
    "region without blocks": (
        _forge({"t": "regions", "regions": [{**_sent(REGION), "nb": 0}]}),
        "bad_field",
    ),
    "long nonce": (_forge({**_sent(SAMPLES[0]), "nonce": b"n" * 65}), "bad_field"),
    "old version": (_forge(GOOD_BEGIN, v=3), "bad_version"),
    "no version": (
        wire.seal(msgspec.msgpack.encode({"sid": b"", "m": GOOD_BEGIN})),
        "bad_version",
    ),
    "sid not bytes": (_forge(GOOD_BEGIN, sid="s"), "malformed"),
    "a flat v3 header": (
        wire.seal(msgspec.msgpack.encode({"v": 3, "t": "ping", "sid": b""})),
        "bad_version",
    ),
    "bad CRC": (wire.encode(BEGIN)[:-1] + b"\x00", "corrupt"),
    "oversized header": (b"\x00" * (wire.MAX_HEADER_BYTES + 1), "oversized_header"),
    "not msgpack": (wire.seal(b"\xc1\xc1"), "malformed"),
}


@pytest.mark.parametrize("case", sorted(BAD_FRAMES))
def test_bad_headers_are_refused_with_their_reason(case: str) -> None:
    raw, reason = BAD_FRAMES[case]
    with pytest.raises(wire.FrameError) as info:
        wire.decode(raw, 1)
    assert info.value.reason == reason, info.value


def test_payloads_only_on_data() -> None:
    with pytest.raises(wire.FrameError, match="bad_parts"):
        wire.decode(wire.encode(BEGIN), 2)
    with pytest.raises(wire.FrameError, match="bad_parts"):
        wire.decode(wire.encode(SAMPLES[10]), 1)


@pytest.fixture
def engine() -> Iterator[TransferEngine]:
    eng = TransferEngine("wire-victim", "decode", TransferConfig(secret=b"s"))
    try:
        yield eng
    finally:
        eng.close()


def test_bad_frames_never_reach_a_handler(engine: TransferEngine) -> None:
    """Each bad frame is counted under its reason; no handler (routing or handshake) runs."""
    core = engine._core  # the dispatcher itself: nothing public hands it raw frames
    reached: list[object] = []
    core._route = lambda msg, session, payload: reached.append(msg)  # type: ignore[method-assign]
    core.linker.on_handshake = lambda msg, *args: reached.append(msg)  # type: ignore[method-assign]

    def feed(raw: bytes, identity: bytes = b"evil") -> None:
        core.loop.call_wait(lambda: core.dispatch([zmq.Frame(raw)], identity=identity), 5)

    for case, (raw, reason) in BAD_FRAMES.items():
        before = engine.metrics().rejected(reason)
        feed(raw)
        assert engine.metrics().rejected(reason) == before + 1, case
    assert reached == []
    feed(wire.encode(SAMPLES[0]))  # a good HELLO does reach the handshake
    assert reached == [SAMPLES[0]]

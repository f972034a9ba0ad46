"""Pure units: wire validation, fault injector, ledger epochs, checksums, error taxonomy."""

from __future__ import annotations

import msgspec
import pytest
import torch

from transfer import StatusCode, TransferError, checksum, layout, wire
from transfer.faults import FaultInjector, FaultPlan, FaultRule
from transfer.handle import TransferHandle
from transfer.ledger import Ledger
from transfer.messages import Ack
from transfer.region import KVRegion


def _forged(msg: object, v: int = wire.VERSION, sid: bytes = b"") -> bytes:
    """A sealed header around any msgpack value (what a hostile peer can send)."""
    return wire.seal(msgspec.msgpack.encode({"v": v, "sid": sid, "m": msg}))


def test_wire_roundtrip_and_rejections() -> None:
    ack = Ack(transfer_id="a", code=0, text="", bad=[1, 2], duplicate=False)
    raw = wire.encode(ack, b"t" * 16)
    header = wire.decode(raw, 1)
    assert header.msg == ack and header.sid == b"t" * 16 and header.v == wire.VERSION
    v = wire.VERSION
    ack_fields = {"t": "ack", "x": "a", "code": 0, "msg": "", "bad": [], "dup": False}
    cases = {
        wire.seal(b"\xc1"): "malformed",
        wire.seal(msgspec.msgpack.encode([1, 2])): "malformed",
        _forged(ack_fields, v=v + 1): "bad_version",
        _forged({"t": "pickle"}): "unknown_type",
        raw[:-1] + bytes([raw[-1] ^ 1]): "corrupt",
        raw[:3] + bytes([raw[3] ^ 0x40]) + raw[4:]: "corrupt",
        b"\x01": "malformed",
        _forged({**ack_fields, "code": True}): "bad_field",
        b"\x00" * (wire.MAX_HEADER_BYTES + 1): "oversized_header",
    }
    for frame, reason in cases.items():
        with pytest.raises(wire.FrameError) as info:
            wire.decode(frame, 1)
        assert info.value.reason == reason
    with pytest.raises(wire.FrameError):
        wire.decode(raw, 2)  # an ack never carries a payload
    with pytest.raises(wire.FrameError, match="bad_field"):
        wire.decode(_forged({**ack_fields, "bad": [1, -1]}), 1)  # block ids are >= 0


def test_fault_injector_is_deterministic() -> None:
    plan = FaultPlan(
        (
            FaultRule("drop", "data", nth=2),
            FaultRule("reorder", "data", nth=3),
            FaultRule("corrupt", "end", nth=1),
        )
    )
    inj = FaultInjector(plan)
    sent = [o.parts[0] for i in range(4) for o in inj.apply("data", [bytes([i])], None)]
    assert sent == [b"\x00", b"\x03", b"\x02"]  # 1 dropped, 2 sent after 3
    (end,) = inj.apply("end", [b"\x00\x00"], None)
    assert end.parts == [b"\x00\x5a"]
    with pytest.raises(ValueError):
        FaultRule("explode")


def test_ledger_epochs_and_fences() -> None:
    region = KVRegion.allocate("kv", 1, 8, (4, 1, 2))
    ledger = Ledger(4)
    ledger.add_region(region)
    h = TransferHandle("r1", "recv", "", "r1")
    res = ledger.reserve(region, "r1", [1, 2], range(1), h, 1e18)
    ids = torch.tensor([1, 2]).numpy()
    assert ledger.check("kv", "r1", res.blocks.epoch, ids) is res
    with pytest.raises(TransferError) as info:
        ledger.check("kv", "r1", res.blocks.epoch + 1, ids)
    assert info.value.code is StatusCode.STALE_EPOCH
    with pytest.raises(TransferError):
        ledger.reserve(region, "r2", [2, 3], range(1), TransferHandle("x", "recv", "", "r2"), 1e18)
    ledger.grant("xid", "kv", [2], until=1e18)
    _, wait = ledger.release("r1")
    assert wait > 0  # a direct writer still holds a grant on block 2
    with pytest.raises(TransferError) as info:
        ledger.reserve(region, "r3", [2], range(1), TransferHandle("y", "recv", "", "r3"), 1e18)
    assert "fenced" in info.value.message
    assert ledger.reserved_blocks() == {"kv": 0}


def test_checksums_agree_and_detect_flips() -> None:
    data = bytes(range(256)) * 64
    for algo in checksum.available():
        whole = checksum.digest(algo, data)
        assert checksum.digest_parts(algo, [data[:1000], data[1000:]]) == whole
        flipped = bytearray(data)
        flipped[77] ^= 1
        assert checksum.digest(algo, flipped) != whole
    assert checksum.resolve("auto") == checksum.available()[0]


def test_error_taxonomy() -> None:
    assert StatusCode.TIMEOUT.recoverable and StatusCode.LINK_FAILED.recoverable
    assert not StatusCode.STALE_EPOCH.recoverable and not StatusCode.REPEAT_REQUEST.recoverable
    assert (
        StatusCode.from_number(StatusCode.KV_CACHE_NOT_EXIST.number)
        is StatusCode.KV_CACHE_NOT_EXIST
    )
    assert len({c.number for c in StatusCode}) == len(StatusCode)


def test_layout_plan_covers_every_block_once() -> None:
    chunks = layout.plan(range(2, 4), 10, 4)
    assert [(c.ti, c.lo, c.hi) for c in chunks] == [
        (2, 0, 4),
        (2, 4, 8),
        (2, 8, 10),
        (3, 0, 4),
        (3, 4, 8),
        (3, 8, 10),
    ]
    assert [c.seq for c in chunks] == list(range(6))


def test_blocks_per_chunk_spreads_blocks_evenly_within_the_cap() -> None:
    assert layout.blocks_per_chunk(100, 1000) == 10  # no count: the cap
    assert layout.blocks_per_chunk(100, 1000, 7) == 7  # one chunk holds everything
    assert layout.blocks_per_chunk(100, 1000, 11) == 6  # 6 + 5, not 10 + 1
    assert layout.blocks_per_chunk(12288, 4 << 20, 512) == 256  # 2 x 256, not 341 + 171
    assert layout.blocks_per_chunk(10_000, 10, 3) == 1  # a block larger than the cap
    for n in range(1, 60):
        bpc = layout.blocks_per_chunk(100, 1000, n)
        assert bpc <= 10 and -(-n // bpc) == -(-n // 10)  # as few chunks as before


def test_datadist_adapter_is_optional() -> None:
    from transfer.transports import datadist

    assert datadist.to_status("LLM_WAIT_PROC_TIMEOUT") is StatusCode.TIMEOUT
    assert datadist.to_status("LLM_REPEAT_REQUEST") is StatusCode.REPEAT_REQUEST
    assert datadist.to_status("SOMETHING_NEW") is StatusCode.INTERNAL
    if not datadist.available():
        with pytest.raises(TransferError):
            datadist.open_datadist(__import__("transfer").Role.PREFILL, 0)


@pytest.mark.parametrize(
    ("msg_type", "fields"),
    [
        ("landed", {"x": "a", "s": [0], "ds": [1], "wv": 1, "g": 1}),  # wv: an int, not a bool
        ("landed", {"x": "a", "s": [0], "ds": [1], "wv": True, "g": True}),  # g: a bool
        ("landed", {"x": "a", "s": [0], "ds": [1], "wv": True}),  # no grant number
        ("landed", {"x": "a", "s": [0], "ds": [1], "g": 1}),  # no wv
        ("grant", {"x": "a", "ttl": 1.0, "until": 2.0, "g": "1"}),
        ("grant", {"x": "a", "ttl": 1.0, "until": 2.0}),
    ],
)
def test_writer_claims_and_grant_numbers_are_validated(
    msg_type: str, fields: dict[str, object]
) -> None:
    """A hostile peer's LANDED/GRANT with a missing or mistyped ``wv``/``g`` is refused before
    anything reads it (a bool is never taken for an int, nor an int for a bool)."""
    raw = _forged({"t": msg_type, **fields}, sid=b"t" * 16)
    with pytest.raises(wire.FrameError, match="bad_field"):
        wire.decode(raw, 1)


def test_a_begin_cannot_claim_more_source_blocks_than_its_reservation_holds() -> None:
    """A BEGIN naming one destination block of 8 tokens and 2**27 source blocks of 16 (block
    sizes differ) once made the receiver allocate a byte per planned chunk (256 MiB here):
    source blocks are bounded by what the reservation can hold, before anything is made."""
    import tracemalloc

    from transfer.incoming import accept_begin
    from transfer.messages import Begin
    from transfer.session import Identity, Session

    region = KVRegion.allocate("kv", 1, 8, (8, 2, 4))
    ledger = Ledger(4)
    ledger.add_region(region)
    res = ledger.reserve(region, "r", [3], range(1), TransferHandle("r", "recv", "", "r"), 1e18)
    me = Identity("decode-0", "decode", "host", 1, "")
    peer = Session("prefill-0", "prefill", "other-host", 2, {}, b"t" * 16)

    def begin(num_src: int, num_tokens: int) -> Begin:
        return Begin(
            transfer_id="x",
            request_id="r",
            epoch=res.blocks.epoch,
            region="kv",
            dst=[3],
            num_src=num_src,
            dtype="float32",
            block_size=16,
            tensors_per_layer=2,
            block_shape=[16, 2, 4],
            layers=(0, 1),
            num_tokens=num_tokens,
            num_chunks=2 * num_src,
            blocks_per_chunk=1,
            checksum=None,
            mode="tcp",
            codec="none",
            layout="nd",
        )

    tracemalloc.start()
    try:
        with pytest.raises(TransferError) as info:
            accept_begin(begin(2**27, 1), peer, me, {"kv": region}, ledger, 2**20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert info.value.code is StatusCode.PARAM_INVALID and "source blocks" in info.value.message
    assert peak < 2**20
    ok = accept_begin(begin(1, 8), peer, me, {"kv": region}, ledger, 2**20)  # 8 tokens fit
    assert ok.num_src_blocks == 1 and len(ok.good) == 2

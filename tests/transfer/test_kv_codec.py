"""The int8 KV wire codec: round trips, refusals, and transfers that use it end to end."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from transfer import KVRegion, StatusCode, TransferConfig, TransferEngine, TransferState, kv_codec
from transfer.kv_codec import KVCodecError, decode, encode, encoded_nbytes

Pair = tuple[TransferEngine, TransferEngine]
SRC = [3, 4, 5, 9, 10, 20, 21, 22, 23, 40]
DST = [1, 2, 6, 7, 8, 30, 31, 32, 33, 50]
INT8 = {"kv_codec": "int8"}


def _kv(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen) * torch.logspace(-3, 2, shape[2]).view(1, 1, -1, 1)
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_error_is_within_half_a_step_per_token_and_head(dtype: torch.dtype) -> None:
    x = _kv((5, 16, 6, 8), dtype)  # heads of very different magnitudes
    data = encode(x)
    assert data.dtype == torch.uint8 and data.numel() == encoded_nbytes("int8", 5, (16, 6, 8), 1)
    assert data.numel() == 5 * 16 * 6 * 4 + x.numel()
    y = decode(data, 5, (16, 6, 8), dtype)
    assert y.dtype == dtype and y.shape == x.shape
    ref = x.float()
    step = ref.abs().amax(dim=3, keepdim=True) / 127  # one scale per token and head
    # half a quantization step, plus the output dtype's own rounding
    bound = step / 2 + ref.abs() * torch.finfo(dtype).eps
    assert bool(((y.float() - ref).abs() <= bound * 1.001).all())
    assert not torch.equal(y, x)  # it is lossy: a test that could not fail proves nothing


@pytest.mark.parametrize("block_shape", [(16,), (16, 64), (4, 2, 3, 8)])
def test_any_block_shape_round_trips(block_shape: tuple[int, ...]) -> None:
    x = torch.randn(3, *block_shape)
    y = decode(encode(x), 3, block_shape, torch.float32)
    assert y.shape == x.shape
    assert float((y - x).abs().max()) <= float(x.abs().max()) / 254 * 1.001


def test_zero_blocks_decode_to_exact_zeros_and_small_values_keep_their_sign() -> None:
    x = torch.zeros(2, 16, 3, 8)
    x[1, :, 2] = 1e-30  # a tiny head next to empty ones
    y = decode(encode(x), 2, (16, 3, 8), torch.float32)
    assert torch.equal(y[0], x[0]) and torch.equal(y[1, :, :2], x[1, :, :2])
    assert torch.allclose(y[1, :, 2], x[1, :, 2], rtol=0.01, atol=0)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_kv_is_refused_not_sent(bad: float) -> None:
    x = torch.randn(2, 16, 2, 8)
    x[1, 3, 0, 5] = bad
    with pytest.raises(KVCodecError, match="inf or nan"):
        encode(x)
    with pytest.raises(Exception) as info:
        kv_codec.to_wire("int8", x)
    assert getattr(info.value, "code", None) is StatusCode.PARAM_INVALID


def test_decode_refuses_wrong_sizes_bad_scales_and_integers() -> None:
    data = encode(torch.randn(2, 16, 2, 8))
    with pytest.raises(KVCodecError, match="take"):
        decode(data[:-1], 2, (16, 2, 8), torch.float32)
    with pytest.raises(KVCodecError, match="take"):
        decode(data, 3, (16, 2, 8), torch.float32)
    for scale in (float("nan"), float("inf"), -1.0):
        hostile = data.clone()
        hostile[:4].view(torch.float32)[0] = scale
        with pytest.raises(KVCodecError, match="scales"):
            decode(hostile, 2, (16, 2, 8), torch.float32)
    with pytest.raises(KVCodecError, match="floating-point"):
        encode(torch.ones(2, 16, 2, 8, dtype=torch.int32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_decode_refuses_finite_scales_that_overflow_the_receivers_dtype(dtype: torch.dtype) -> None:
    """A finite scale is not enough: 3e38 x 127 is inf in float32, and 1e3 x 127 is inf once
    cast into a float16 cache. Such blocks would put inf into the cache, where masked
    attention turns it into NaN for other rows; the receiver refuses them instead."""
    data = encode(torch.randn(2, 16, 2, 8))
    limit = torch.finfo(dtype).max
    hostile = data.clone()
    hostile[:4].view(torch.float32)[0] = limit / 64  # x 128 (int8 -128) overflows
    hostile[4 * 64 :].view(torch.int8)[0] = -128
    with pytest.raises(KVCodecError, match="overflow"):
        decode(hostile, 2, (16, 2, 8), dtype)
    fits = data.clone()
    fits[:4].view(torch.float32)[0] = limit / 128
    assert torch.isfinite(decode(fits, 2, (16, 2, 8), dtype)).all()


def test_codec_settings_and_refusals_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match=r"TransferConfig\.kv_codec 'int4'.*none, int8"):
        TransferConfig(kv_codec="int4")
    assert TransferConfig(kv_codec="int8").kv_codec == "int8"
    f32 = torch.float32
    assert kv_codec.refusal("none", "none", "shm", f32) is None
    assert kv_codec.refusal("int8", "int8", "tcp", f32) is None
    assert "unknown here" in str(kv_codec.refusal("zstd", "int8", "tcp", f32))
    assert "not enabled here" in str(kv_codec.refusal("int8", "none", "tcp", f32))
    assert "direct" in str(kv_codec.refusal("int8", "int8", "shm", f32))
    assert "floating point" in str(kv_codec.refusal("int8", "int8", "tcp", torch.int8))


def _push(p: TransferEngine, d: TransferEngine, rid: str, transport: str = "tcp") -> Any:
    recv = d.reserve(rid, DST, writer=p.engine_id)
    assert recv.blocks is not None
    return recv, p.push_blocks(d.engine_id, SRC, recv.blocks, transport=transport)


def _sent(engine: TransferEngine, transport: str) -> int:
    return engine.metrics().transport(transport).bytes_sent_total


@pytest.mark.parametrize("data_channel", [True, False])
def test_int8_push_over_tcp_lands_the_decoded_blocks(
    make_pair: Callable[..., Pair], data_channel: bool
) -> None:
    """Over the data channel and as ZMQ frames: what lands is exactly decode(encode(src)),
    checksums verified over the encoded bytes, and about a quarter of the bytes move."""
    flags = {"data_channel": data_channel}
    p, d = make_pair(sender={**INT8, **flags}, receiver={**INT8, **flags})
    recv, h = _push(p, d, "int8")
    assert h.wait(15) is TransferState.DONE, h.error
    assert recv.wait(5) is TransferState.DONE
    src_ids = torch.tensor(SRC)
    for got, src in zip(d.region().tensors, p.region().tensors, strict=True):
        want = decode(encode(src[src_ids]), len(SRC), (16, 2, 8), torch.float32)
        assert torch.equal(got[DST], want)
    raw = len(SRC) * 16 * 2 * 8 * 4 * len(p.region().tensors)
    assert _sent(p, "tcp") == raw // 4 + len(SRC) * 16 * 2 * 4 * len(p.region().tensors)
    assert d.metrics().transport("tcp").checksum_failures_total == 0
    d.release("int8")


def test_int8_decodes_into_the_receivers_dtype(make_pair: Callable[..., Pair]) -> None:
    p, d = make_pair(sender=INT8, receiver=INT8)
    d.register_region(KVRegion.allocate("half", 4, 64, (16, 2, 8), torch.bfloat16))
    recv = d.reserve("bf16", DST, region="half", writer=p.engine_id)
    assert recv.blocks is not None
    h = p.push_blocks(d.engine_id, SRC, recv.blocks, transport="tcp")
    assert h.wait(15) is TransferState.DONE, h.error
    src = p.region().tensors[0][torch.tensor(SRC)]
    want = decode(encode(src), len(SRC), (16, 2, 8), torch.bfloat16)
    assert torch.equal(d.region("half").tensors[0][DST], want)
    d.release("bf16")


def test_a_receiver_without_the_codec_refuses_it(make_pair: Callable[..., Pair]) -> None:
    p, d = make_pair(sender=INT8)  # receiver: kv_codec none
    recv, h = _push(p, d, "refused")
    assert h.wait(15) is TransferState.FAILED
    assert h.error is not None and h.error.code is StatusCode.PARAM_INVALID
    assert "kv_codec" in h.error.message and "not enabled here" in h.error.message
    assert recv.wait(0.01) is TransferState.PENDING
    d.release("refused")
    assert p.held_blocks() == {}


def test_direct_writes_stay_raw_and_exact(make_pair: Callable[..., Pair]) -> None:
    p, d = make_pair(sender=INT8, receiver=INT8)
    recv, h = _push(p, d, "shm", transport="shm")
    assert h.wait(15) is TransferState.DONE, h.error
    assert recv.wait(5) is TransferState.DONE
    for got, src in zip(d.region().tensors, p.region().tensors, strict=True):
        assert torch.equal(got[DST], src[SRC])
    d.release("shm")


def test_non_finite_kv_fails_the_push_clearly(make_pair: Callable[..., Pair]) -> None:
    p, d = make_pair(sender=INT8, receiver=INT8)
    p.region().tensors[1][SRC[0], 0, 0, 0] = float("nan")
    recv, h = _push(p, d, "nan")
    assert h.wait(15) is TransferState.FAILED
    assert h.error is not None and h.error.code is StatusCode.PARAM_INVALID
    assert "inf or nan" in h.error.message
    assert recv.wait(0.01) is TransferState.PENDING
    d.release("nan")
    assert p.held_blocks() == {}


@pytest.mark.parametrize("damage", ["raw_bytes", "nan_scales"])
def test_frames_that_do_not_match_the_codec_are_never_written(
    make_pair: Callable[..., Pair], monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    """A sender that announces int8 but sends raw-sized chunks, or int8 chunks with NaN
    scales (their checksums match: only the codec's own checks can catch them)."""
    honest = kv_codec.to_wire

    def hostile(codec: str, chunk: torch.Tensor) -> torch.Tensor:
        if damage == "raw_bytes":
            return honest("none", chunk)
        data = honest(codec, chunk).clone()
        data[:4].view(torch.float32)[0] = float("nan")
        return data

    monkeypatch.setattr(kv_codec, "to_wire", hostile)
    retry = {"attempts": 2, "base_delay_s": 0.01, "max_delay_s": 0.01}
    p, d = make_pair(sender={**INT8, "retry": retry}, receiver=INT8)
    before = d.region().tensors[0][DST].clone()
    recv, h = _push(p, d, damage)
    assert h.wait(30) is not TransferState.DONE
    assert recv.wait(0.01) is TransferState.PENDING  # never committed
    rejected = d.metrics().frames_rejected
    assert rejected.get("bad_size" if damage == "raw_bytes" else "bad_field", 0) >= 1
    if damage == "raw_bytes":  # refused before a byte was read into the blocks
        assert torch.equal(d.region().tensors[0][DST], before)
    d.release(damage)
    assert p.held_blocks() == {}

"""Hidden-state codec: round trips through msgpack, bounded error, hostile frames rejected."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
import torch

from edge import EdgeRuntime
from edge.codec import (
    CodecError,
    accuracy,
    bytes_per_token,
    decode,
    encode,
    measure,
)


def hidden(rows: int = 5, cols: int = 64, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, cols, generator=g)
    h[1 % rows] *= 40.0  # tokens differ in scale (as real early-layer outputs do)
    h[-1, 3 % cols] = 300.0  # one outlier feature
    return h


@pytest.mark.parametrize("codec", ["float32", "float16", "int8"])
def test_round_trip_through_msgpack(codec: str) -> None:
    h = hidden()
    frame = msgspec.msgpack.decode(msgspec.msgpack.encode(encode(h, codec)))
    payload = sum(len(v) for v in frame.values() if isinstance(v, bytes))
    assert payload == h.shape[0] * bytes_per_token(64, codec)
    out = decode(frame, hidden_size=64)
    assert out.dtype == torch.float32 and out.shape == h.shape
    if codec == "float32":
        assert torch.equal(out, h)
    elif codec == "float16":
        torch.testing.assert_close(out, h, rtol=1e-3, atol=0)
    else:
        # Per-token scale: the error of each token is at most half a step of its own scale.
        step = h.abs().amax(dim=1, keepdim=True) / 127
        assert bool(((out - h).abs() <= step / 2 + 1e-6).all())


@pytest.mark.parametrize("outliers", [0, 2, 8])
def test_int8_keeps_zero_rows_and_signs(outliers: int) -> None:
    h = torch.zeros(2, 8)
    h[1] = torch.tensor([-1.0, 1.0, 0.5, -0.25, 0, 0, 0, 2.0])
    out = decode(encode(h, "int8", outliers))
    assert torch.equal(out[0], torch.zeros(8))
    assert torch.equal(out[1].sign(), h[1].sign())
    assert out[1, 7] == pytest.approx(2.0)


def test_int8_outliers_travel_exactly_and_spare_the_rest() -> None:
    h = hidden(3, 64)
    h[:, 10] = 25_000.0  # a massive activation, as early LLM layers have
    plain, split = decode(encode(h, "int8", 0)), decode(encode(h, "int8", 4))
    assert torch.equal(split[:, 10], h[:, 10])
    rest = torch.ones(64, dtype=torch.bool)
    rest[10] = False
    # Without the split the outlier's scale rounds most ordinary features to zero.
    assert (plain[:, rest] - h[:, rest]).abs().max() > 50 * (
        split[:, rest] - h[:, rest]
    ).abs().max()
    assert bytes_per_token(64, "int8", 4) == 64 + 4 + 4 * 6


def test_accuracy_statistics() -> None:
    ref = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    got = torch.tensor([[1.0, 0.0], [0.0, 1.5]])
    acc = accuracy(ref, got)
    assert acc.max_abs_error == pytest.approx(0.5)
    assert acc.mean_abs_error == pytest.approx(0.125)
    assert acc.max_rel_error == pytest.approx(0.25)
    assert acc.min_cosine == pytest.approx(1.0)
    assert measure(hidden(), "float32").max_abs_error == 0.0
    with pytest.raises(ValueError, match="shapes differ"):
        accuracy(ref, got[:1])


def test_encode_rejects_bad_hidden_states() -> None:
    with pytest.raises(CodecError, match="unknown hidden-state codec 'bf16'"):
        encode(hidden(), "bf16")
    with pytest.raises(CodecError, match=r"\[num_tokens, hidden\]"):
        encode(torch.zeros(64), "int8")
    with pytest.raises(CodecError, match="NaN"):
        encode(torch.full((1, 4), float("nan")), "int8")
    with pytest.raises(CodecError, match="float16 range"):
        encode(torch.full((1, 4), 1e6), "float16")


def good() -> dict[str, Any]:
    return encode(hidden(2, 4), "int8", outliers=1)


def with_index(*index: int) -> dict[str, Any]:
    return {**good(), "outlier_index": np.array(index, "<u2").tobytes()}


BAD_FRAMES: list[tuple[Any, str]] = [
    ([1, 2], "must be a map"),
    ({**good(), "extra": 1}, r"unexpected \['extra'\]"),
    ({k: v for k, v in good().items() if k != "scale"}, r"missing \['scale'\]"),
    ({**good(), "version": 2}, "version 2"),
    ({**good(), "version": True}, "version True"),
    ({**good(), "dtype": "int4"}, "dtype 'int4'"),
    ({**good(), "dtype": None}, "dtype None"),
    ({**good(), "shape": [2]}, "shape"),
    ({**good(), "shape": [2, -4]}, "shape"),
    ({**good(), "shape": [2, True]}, "shape"),
    ({**good(), "shape": "2x4"}, "shape"),
    ({**good(), "shape": [1 << 20, 1 << 20]}, "is over"),
    ({**good(), "shape": [3, 4]}, "'data' has 8 bytes, not 12"),
    ({**good(), "data": good()["data"][:-1]}, "'data' has 7 bytes"),
    ({**good(), "data": "text"}, "'data' must be bytes"),
    ({**good(), "scale": b"\x00" * 4}, "'scale' has 4 bytes, not 8"),
    ({**good(), "outliers": 2}, "'outlier_index' has 4 bytes, not 8"),
    ({**good(), "outliers": 5}, "outliers 5"),
    ({**good(), "outliers": -1}, "outliers -1"),
    ({**good(), "outliers": True}, "outliers True"),
    (with_index(0, 4), "indices repeat or pass 4"),
    ({**encode(hidden(1, 4), "int8", 2), "outlier_index": b"\x01\x00\x01\x00"}, "repeat"),
    ({**good(), "outlier_value": b"\x00\x00\xc0\x7f" * 2}, "outlier values hold NaN"),
    ({**good(), "outlier_value": None}, "'outlier_value' must be bytes"),
    ({**encode(hidden(2, 4), "float16"), "outliers": 1}, "outliers for float"),
    ({**good(), "scale": b"\x00\x00\xc0\x7f" * 2}, "finite and non-negative"),
    ({**good(), "scale": b"\x00\x00\x80\xbf" * 2}, "finite and non-negative"),
    ({**encode(hidden(2, 4), "float16"), "scale": b"\x00"}, "'scale' has 1 bytes, not 0"),
    ({**encode(hidden(1, 2), "float16"), "data": b"\x00\x7c\x00\x00"}, "NaN or infinity"),
    # Finite scales whose product with the data is not: 127 x 3e38 overflows float32.
    ({**good(), "scale": np.array([3e38, 1.0], "<f4").tobytes()}, "values overflow"),
]


@pytest.mark.parametrize(("frame", "message"), BAD_FRAMES)
def test_malformed_frames_raise_value_error(frame: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decode(frame)


def test_hidden_size_mismatch_is_named() -> None:
    with pytest.raises(CodecError, match="4 features per token, expected 576"):
        decode(good(), hidden_size=576)


def test_random_bytes_never_crash() -> None:
    """Fuzz: flipped bytes in a packed frame either decode into finite float32 values of
    the frame's shape or raise ValueError naming the problem; nothing else happens."""
    packed = bytearray(msgspec.msgpack.encode(good()))
    g = torch.Generator().manual_seed(0)
    outcomes: Counter[str] = Counter()
    for _ in range(300):
        data = bytearray(packed)
        for i in torch.randint(0, len(data), (3,), generator=g).tolist():
            data[i] = int(torch.randint(0, 256, (1,), generator=g))
        try:
            frame = msgspec.msgpack.decode(bytes(data))
        except (ValueError, msgspec.DecodeError):
            outcomes["not msgpack"] += 1
            continue
        try:
            values = decode(frame)
        except ValueError:
            outcomes["refused"] += 1
            continue
        outcomes["decoded"] += 1
        assert values.dtype == torch.float32 and bool(values.isfinite().all())
        assert list(values.shape) == frame["shape"]
    assert outcomes["refused"] and outcomes["decoded"], outcomes  # both paths were taken


def test_codec_accuracy_on_edge_hidden_states(tiny_llama_dir: Path) -> None:
    h = EdgeRuntime(tiny_llama_dir, 2, max_positions=64).prefill(list(range(1, 40)))
    fp16, int8 = measure(h, "float16"), measure(h, "int8")
    assert fp16.min_cosine > 0.99999
    assert int8.min_cosine > 0.999
    assert int8.max_rel_error <= 0.5 / 127 + 1e-6

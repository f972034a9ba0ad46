"""Hidden-state codec for the edge-cloud link: float32 (lossless), float16, and int8.

int8 is symmetric per token, with that token's `outliers` largest-magnitude features sent
apart in float32. Early-layer hidden states of LLMs carry a few "massive activations" (up to
~25000 in SmolLM2 where the rest is ~1); a plain per-token scale lets them crush the other
features to a few levels, while splitting out 8 per token keeps greedy tokens in agreement
with the unsplit model at ~99% for ~55% of float16's bytes (teacher-forced, k = 4..24).

Frames are plain dicts of str/int/bytes, ready for msgpack; all numbers little-endian::

    {"version": 1, "dtype": "int8", "shape": [num_tokens, hidden],
     "scale": num_tokens x float32,  "data": num_tokens x hidden x int8,
     "outliers": m, "outlier_index": num_tokens x m x uint16,
     "outlier_value": num_tokens x m x float32}

float16/float32 frames have "scale", "outlier_index" and "outlier_value" empty and
"outliers" 0. `decode` treats a frame as untrusted network input: every field is checked and
anything malformed raises `CodecError` (a ValueError) naming the problem; it never crashes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

VERSION = 1
# codec -> numpy dtype of "data"
_DATA_DTYPES: dict[str, str] = {"float32": "<f4", "float16": "<f2", "int8": "i1"}
CODECS = tuple(_DATA_DTYPES)
DEFAULT_OUTLIERS = 8
_FIELDS = {"version", "dtype", "shape", "scale", "data", "outliers"} | {
    "outlier_index",
    "outlier_value",
}
# Bounds, so a hostile frame cannot make the receiver allocate gigabytes.
MAX_ELEMENTS = 1 << 26
MAX_OUTLIERS = 256

__all__ = ["CODECS", "CodecAccuracy", "CodecError", "accuracy", "decode", "encode", "measure"]


class CodecError(ValueError):
    """A frame (or a hidden state to encode) is malformed."""


def bytes_per_token(hidden_size: int, codec: str, outliers: int = DEFAULT_OUTLIERS) -> int:
    """Payload bytes one token's hidden state takes on the wire (all byte fields)."""
    _check_codec(codec)
    if codec != "int8":
        return hidden_size * np.dtype(_DATA_DTYPES[codec]).itemsize
    return hidden_size + 4 + min(outliers, hidden_size) * 6


def encode(
    hidden: torch.Tensor, codec: str = "float16", outliers: int = DEFAULT_OUTLIERS
) -> dict[str, Any]:
    """Encodes hidden states [num_tokens, hidden] into a msgpack-friendly frame.

    `outliers` (int8 only) is how many features per token (at most all) travel apart in
    float32; 0 gives plain per-token int8.
    """
    _check_codec(codec)
    if hidden.dim() != 2 or hidden.shape[0] < 1 or hidden.shape[1] < 1:
        raise CodecError(f"hidden states must be [num_tokens, hidden], got {tuple(hidden.shape)}")
    x = hidden.detach().to("cpu", torch.float32)
    if not bool(torch.isfinite(x).all()):
        raise CodecError("hidden states contain NaN or infinity; refusing to send them")
    frame: dict[str, Any] = {
        "version": VERSION,
        "dtype": codec,
        "shape": [int(x.shape[0]), int(x.shape[1])],
        "scale": b"",
        "data": b"",
        "outliers": 0,
        "outlier_index": b"",
        "outlier_value": b"",
    }
    if codec == "int8":
        if not 0 <= outliers <= MAX_OUTLIERS:
            raise CodecError(f"outliers must be in [0, {MAX_OUTLIERS}], got {outliers}")
        outliers = min(outliers, x.shape[1])
        if outliers:
            # index, value: [num_tokens, outliers]; the rest is quantized without them.
            index = x.abs().topk(outliers, dim=1).indices
            frame["outliers"] = outliers
            frame["outlier_index"] = index.numpy().astype("<u2").tobytes()
            frame["outlier_value"] = x.gather(1, index).numpy().astype("<f4").tobytes()
            x = x.scatter(1, index, 0.0)
        # Symmetric per token: row r maps [-amax_r, amax_r] onto [-127, 127].
        scale = x.abs().amax(dim=1, keepdim=True) / 127.0
        q = torch.round(x / torch.where(scale > 0, scale, torch.ones_like(scale)))
        frame["data"] = q.clamp_(-127, 127).to(torch.int8).numpy().tobytes()
        frame["scale"] = scale.squeeze(1).numpy().astype("<f4").tobytes()
    elif codec == "float16" and float(x.abs().max()) > 65504.0:
        raise CodecError("hidden states exceed the float16 range (65504); use int8 or float32")
    else:
        frame["data"] = x.numpy().astype(_DATA_DTYPES[codec]).tobytes()
    return frame


def frame_rows(frame: Mapping[str, Any], hidden_size: int | None = None) -> int:
    """How many tokens a frame holds, once its fields, shape and data size are checked (its
    values are not: `decode` checks those). For a relay that forwards frames unread."""
    return _header(frame, hidden_size)[1]


def decode(frame: Mapping[str, Any], hidden_size: int | None = None) -> torch.Tensor:
    """Decodes a frame from the network into finite float32 [num_tokens, hidden] on the CPU
    (whether they fit a narrower dtype is for the receiver to check).

    With `hidden_size`, the frame must carry exactly that many features per token.
    """
    codec, rows, cols, data = _header(frame, hidden_size)
    values = np.frombuffer(data, _DATA_DTYPES[codec]).astype(np.float32).reshape(rows, cols)
    if codec != "int8":
        for field in ("scale", "outlier_index", "outlier_value"):
            _bytes(frame, field, 0)
        if frame["outliers"] != 0 or not np.isfinite(values).all():
            raise CodecError("hidden-state frame holds NaN or infinity, or outliers for float")
        return torch.from_numpy(values)
    scale = np.frombuffer(_bytes(frame, "scale", rows * 4), "<f4")
    if not (np.isfinite(scale).all() and (scale >= 0).all()):
        raise CodecError("hidden-state frame scales must be finite and non-negative")
    with np.errstate(over="ignore"):
        values *= scale[:, None]
    if not np.isfinite(values).all():
        raise CodecError("hidden-state frame values overflow float32: a scale x data is not finite")
    m = frame["outliers"]
    if not isinstance(m, int) or isinstance(m, bool) or not 0 <= m <= min(MAX_OUTLIERS, cols):
        raise CodecError(
            f"hidden-state frame outliers {m!r}; expected 0..{min(MAX_OUTLIERS, cols)}"
        )
    index = np.frombuffer(_bytes(frame, "outlier_index", rows * m * 2), "<u2").reshape(rows, m)
    outlier_values = np.frombuffer(_bytes(frame, "outlier_value", rows * m * 4), "<f4").reshape(
        rows, m
    )
    if m:
        ordered = np.sort(index, axis=1)
        if ordered[:, -1].max() >= cols or (np.diff(ordered, axis=1) == 0).any():
            raise CodecError(f"hidden-state frame outlier indices repeat or pass {cols}")
        if not np.isfinite(outlier_values).all():
            raise CodecError("hidden-state frame outlier values hold NaN or infinity")
        np.put_along_axis(values, index.astype(np.int64), outlier_values, axis=1)
    return torch.from_numpy(values)


@dataclass(frozen=True, slots=True)
class CodecAccuracy:
    """Error statistics over a batch of tokens' hidden states."""

    max_abs_error: float
    mean_abs_error: float
    max_rel_error: float  # per token max |error| / max |value|, worst token
    min_cosine: float  # worst token's cosine similarity
    mean_cosine: float

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def accuracy(reference: torch.Tensor, decoded: torch.Tensor) -> CodecAccuracy:
    """Error statistics of `decoded` against `reference` (both [num_tokens, hidden])."""
    if reference.shape != decoded.shape:
        raise ValueError(f"shapes differ: {tuple(reference.shape)} vs {tuple(decoded.shape)}")
    ref, dec = reference.double(), decoded.double()
    err = (dec - ref).abs()
    peak = ref.abs().amax(dim=1).clamp_min(1e-30)
    cos = torch.nn.functional.cosine_similarity(ref, dec, dim=1)
    return CodecAccuracy(
        max_abs_error=float(err.max()),
        mean_abs_error=float(err.mean()),
        max_rel_error=float((err.amax(dim=1) / peak).max()),
        min_cosine=float(cos.min()),
        mean_cosine=float(cos.mean()),
    )


def measure(hidden: torch.Tensor, codec: str, outliers: int = DEFAULT_OUTLIERS) -> CodecAccuracy:
    """Round-trips `hidden` through `codec` and reports the error."""
    return accuracy(hidden.float(), decode(encode(hidden, codec, outliers)))


def _check_codec(codec: str) -> None:
    if codec not in _DATA_DTYPES:
        raise CodecError(f"unknown hidden-state codec {codec!r}; choose one of {CODECS}")


def _header(
    frame: Mapping[str, Any], hidden_size: int | None
) -> tuple[str, int, int, bytes | bytearray | memoryview]:
    """(codec, rows, cols, data) of a frame whose fields, shape and data size are right."""
    if not isinstance(frame, Mapping):
        raise CodecError(f"a hidden-state frame must be a map, got {type(frame).__name__}")
    keys = set(frame)
    if keys != _FIELDS:
        missing, extra = sorted(_FIELDS - keys), sorted(map(str, keys - _FIELDS))
        raise CodecError(f"hidden-state frame fields wrong: missing {missing}, unexpected {extra}")
    if frame["version"] != VERSION or isinstance(frame["version"], bool):
        raise CodecError(f"hidden-state frame version {frame['version']!r}; expected {VERSION}")
    codec = frame["dtype"]
    if not isinstance(codec, str) or codec not in _DATA_DTYPES:
        raise CodecError(f"hidden-state frame dtype {codec!r}; expected one of {CODECS}")
    rows, cols = _check_shape(frame["shape"], hidden_size)
    data = _bytes(frame, "data", rows * cols * np.dtype(_DATA_DTYPES[codec]).itemsize)
    return codec, rows, cols, data


def _check_shape(shape: Any, hidden_size: int | None) -> tuple[int, int]:
    ok = isinstance(shape, (list, tuple)) and len(shape) == 2
    ok = ok and all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape)
    if not ok:
        raise CodecError(f"hidden-state frame shape {shape!r}; expected [num_tokens, hidden] >= 1")
    rows, cols = int(shape[0]), int(shape[1])
    if rows * cols > MAX_ELEMENTS:
        raise CodecError(f"hidden-state frame of {rows}x{cols} values is over {MAX_ELEMENTS}")
    if hidden_size is not None and cols != hidden_size:
        raise CodecError(
            f"hidden-state frame has {cols} features per token, expected {hidden_size}"
        )
    return rows, cols


def _bytes(frame: Mapping[str, Any], field: str, size: int) -> bytes | bytearray | memoryview:
    value = frame[field]
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise CodecError(f"hidden-state frame field {field!r} must be bytes")
    if len(value) != size:
        raise CodecError(f"hidden-state frame field {field!r} has {len(value)} bytes, not {size}")
    return value

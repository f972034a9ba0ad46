"""KV codecs for the stream (TCP) wire: ``none`` (raw bytes) and ``int8``.

``int8`` quantizes a chunk of KV blocks symmetrically with one float32 scale per block, per
token in the block and per head (absmax over the head's ``head_dim`` values / 127). A chunk
of ``n`` blocks of shape ``(block_size, *heads, head_dim)`` goes on the wire as::

    [ scales: float32 [n, block_size, H] ][ values: int8 [n, block_size, H, head_dim] ]
      H = prod(heads) (1 when the block has no head dimension)

so the encoded size is a pure function of ``n`` and the block shape, which the receiver
checks before it reads anything: 0.27x of float32 with SmolLM2's head_dim 64. Decoding
multiplies back into the receiver's dtype. Each value is off by at most half its scale
(``absmax / 254``) before rounding to that dtype. One scale per block and head (absmax over
all the block's tokens) would send 0.25x but let one loud token flatten its neighbours: on
SmolLM2-135M it kept 95.9% teacher-forced top-1 agreement, per token 100% (docs/BENCHMARKS.md).

Non-finite KV cannot be quantized: :func:`encode` refuses it (the transfer fails with
PARAM_INVALID, never sends garbage). :func:`decode` refuses scales that are not finite
and non-negative, or so large that a value would overflow the receiver's dtype (a finite
3e38 x 127 is inf, and inf in a cache slot becomes NaN in other rows' masked attention).
Both raise :class:`KVCodecError`.
"""

from __future__ import annotations

import math

import torch

from transfer import layout
from transfer.devices import to_host
from transfer.errors import StatusCode, TransferError

#: Codecs an engine may use on the stream wire (``transfer.kv_codec``).
CODECS = ("none", "int8")
_SCALE_BYTES = 4
_QMAX = 127.0
#: Smallest absmax used for a scale (127 / it stays finite in float32).
_FLOOR = 1e-30


class KVCodecError(ValueError):
    """A chunk that cannot be encoded, or encoded bytes that cannot be decoded."""


def check_codec(name: str, key: str = "kv_codec") -> str:
    """``name`` if it is a known codec; ValueError naming ``key`` otherwise."""
    if name not in CODECS:
        raise ValueError(f"{key} {name!r}: choose one of {', '.join(CODECS)}")
    return name


def _grid(block_shape: tuple[int, ...]) -> tuple[int, int, int]:
    """``(block_size, heads, head_dim)`` of a block shape (heads: all middle dims)."""
    if len(block_shape) == 1:
        return block_shape[0], 1, 1
    return block_shape[0], math.prod(block_shape[1:-1]), block_shape[-1]


def encoded_nbytes(codec: str, num_blocks: int, block_shape: tuple[int, ...], itemsize: int) -> int:
    """Bytes ``num_blocks`` blocks of ``block_shape`` take on the wire under ``codec``
    (``itemsize``: bytes per element of the raw dtype)."""
    values = num_blocks * math.prod(block_shape)
    if codec == "none":
        return values * itemsize
    _, heads, _ = _grid(block_shape)
    return num_blocks * block_shape[0] * heads * _SCALE_BYTES + values


@torch.inference_mode()
def encode(chunk: torch.Tensor) -> torch.Tensor:
    """int8-encode ``chunk`` ``[n, *block_shape]`` (a floating dtype, any device: computed
    there) into a 1-D uint8 CPU tensor laid out as in the module docstring."""
    if not chunk.is_floating_point():
        raise KVCodecError(f"int8 KV codec needs a floating-point KV cache, not {chunk.dtype}")
    n = int(chunk.shape[0])
    bs, heads, dim = _grid(tuple(chunk.shape[1:]))
    x = chunk.detach().to(torch.float32).reshape(n, bs, heads, dim)
    amax = x.abs().amax(dim=3, keepdim=True)  # [n, bs, H, 1]; nan and inf propagate here
    if not bool(torch.isfinite(amax).all()):
        raise KVCodecError(
            "KV holds inf or nan: it cannot be int8-encoded (kv_codec: none sends it raw)"
        )
    amax.clamp_min_(_FLOOR)  # all-zero heads: q = 0, any scale decodes them exactly
    q = torch.mul(x, _QMAX / amax).round_()  # |q| <= 127: amax bounds every value
    head = amax.numel() * _SCALE_BYTES
    out = torch.empty(head + q.numel(), dtype=torch.uint8, device=x.device)
    out[:head].view(torch.float32).copy_(amax.reshape(-1)).div_(_QMAX)
    out[head:].view(torch.int8).view(q.shape).copy_(q)
    return to_host(out)


@torch.inference_mode()
def decode(
    data: torch.Tensor, num_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor:
    """Blocks ``[num_blocks, *block_shape]`` of ``dtype`` (CPU) from an :func:`encode`\\ d
    uint8 tensor; KVCodecError for a wrong size or bad scales."""
    bs, heads, dim = _grid(block_shape)
    want = encoded_nbytes("int8", num_blocks, block_shape, 1)
    raw = data.reshape(-1)
    if raw.dtype != torch.uint8 or raw.numel() != want:
        raise KVCodecError(
            f"int8 chunk of {raw.numel()} bytes; {num_blocks} blocks of {block_shape} take {want}"
        )
    head = num_blocks * bs * heads * _SCALE_BYTES
    scale = raw[:head].clone().view(torch.float32)  # clone: aligned, and ours
    if not bool((torch.isfinite(scale) & (scale >= 0)).all()):
        raise KVCodecError("int8 chunk with scales that are not finite and >= 0")
    # |q| <= 128, so a scale up to max / 128 decodes finite in float32 and in `dtype`.
    limit = min(torch.finfo(dtype).max, torch.finfo(torch.float32).max) / 128
    if not bool((scale <= limit).all()):
        name = str(dtype).removeprefix("torch.")
        raise KVCodecError(f"int8 chunk with scales that overflow {name} (scale <= {limit:.4g})")
    q = raw[head:].view(torch.int8).reshape(num_blocks, bs, heads, dim)
    x = q.to(torch.float32).mul_(scale.view(num_blocks, bs, heads, 1))
    return x.to(dtype).reshape(num_blocks, *block_shape)


def to_wire(codec: str, chunk: torch.Tensor) -> torch.Tensor:
    """What a stream transfer sends for ``chunk`` under ``codec`` (a CPU tensor);
    PARAM_INVALID for KV the codec cannot encode."""
    if codec == "none":
        return to_host(chunk)
    try:
        return encode(chunk)
    except KVCodecError as exc:
        raise TransferError(StatusCode.PARAM_INVALID, str(exc)) from None


def from_wire(
    codec: str,
    payload: memoryview,
    num_blocks: int,
    block_shape: tuple[int, ...],
    src_dtype: torch.dtype,
    dst_dtype: torch.dtype,
) -> torch.Tensor:
    """The blocks a received (size-checked) payload holds: a view of raw bytes in
    ``src_dtype``, or int8 decoded into ``dst_dtype``."""
    if codec == "none":
        return layout.from_bytes(payload, src_dtype, (num_blocks, *block_shape))
    return decode(torch.frombuffer(payload, dtype=torch.uint8), num_blocks, block_shape, dst_dtype)


def refusal(codec: str, accepted: str, mode: str, src_dtype: torch.dtype) -> str | None:
    """Why a receiver whose own codec is ``accepted`` refuses a BEGIN announcing ``codec``
    (None: it takes it). Raw KV is always taken; a codec only when enabled on both ends."""
    if codec == "none":
        return None
    if codec not in CODECS:
        return f"kv codec {codec!r} unknown here (known: {', '.join(CODECS)})"
    if codec != accepted:
        return (
            f"kv codec {codec!r} not enabled here (this receiver's transfer.kv_codec is "
            f"{accepted!r}): set the same kv_codec on both ends"
        )
    if mode != "tcp":
        return f"kv codec {codec!r} on the direct transport {mode!r} (direct writes are raw)"
    if not src_dtype.is_floating_point:
        return f"kv codec {codec!r} for a {src_dtype} cache (floating point only)"
    return None

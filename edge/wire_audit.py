"""Privacy audit of what the edge sent: searches captured bytes for the prompt's text and for
recognizable encodings of its token ids, at every byte offset. Used by the end-to-end test.

What counts as a leak (every run is searched, not only aligned ones):
- text: any `min_text_chars` consecutive characters of the prompt as UTF-8, UTF-16-LE or
  JSON-escaped; the whole prompt also as UTF-16-BE, UTF-32-LE and base64 (any alignment);
- token ids: any `window` consecutive ids as an int16/uint16/int32/int64 (LE or BE), float32
  or float16 array; as msgpack ints or a decimal list ("1,2,3" / "1, 2, 3", as in JSON) once
  the run is at least `MIN_VARIABLE_BYTES` long (those take as little as a byte per id); the
  whole list as a msgpack array.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np

from edge.needle_search import find_all

_ARRAYS = {
    "<i2": "int16 little-endian",
    ">i2": "int16 big-endian",
    "<u2": "uint16 little-endian",
    "<i4": "int32 little-endian",
    ">i4": "int32 big-endian",
    "<i8": "int64 little-endian",
    ">i8": "int64 big-endian",
    "<f4": "float32 little-endian",
    "<f2": "float16 little-endian",
}
# Shorter needles would match random binary (hidden states) by chance.
MIN_NEEDLE_BYTES = 6
MIN_VARIABLE_BYTES = 12


@dataclass(frozen=True, slots=True)
class Leak:
    """One place where the prompt shows up in the captured bytes."""

    what: str  # "prompt text (utf-8)", "token ids (int32 little-endian)", ...
    offset: int  # byte offset of the first occurrence in the captured data
    tokens: tuple[int, int] | None = None  # prompt tokens [start, end) found, for token ids


class PromptLeakError(AssertionError):
    """Prompt text or token ids were found in what the edge sent."""


def find_prompt_leaks(
    captured: bytes | bytearray | memoryview,
    text: str,
    token_ids: Sequence[int],
    *,
    min_text_chars: int = 12,
    window: int = 4,
) -> list[Leak]:
    """Every prompt fragment (see the module docstring) found in `captured`, by offset."""
    needles: dict[bytes, tuple[str, tuple[int, int] | None]] = {}
    ids = [int(t) for t in token_ids]
    found: list[tuple[str, bytes, tuple[int, int] | None]] = []
    if text:
        found += _text_needles(text, min_text_chars)
    if ids:
        found += _id_needles(ids, window)
    for what, needle, tokens in found:
        if len(needle) >= MIN_NEEDLE_BYTES:
            needles.setdefault(needle, (what, tokens))
    hits = find_all(bytes(captured), list(needles))
    leaks = []
    for needle, offset in hits.items():
        what, tokens = needles[needle]
        leaks.append(Leak(what, offset, tokens))
    return sorted(leaks, key=lambda leak: leak.offset)


def assert_no_prompt_leak(
    captured: bytes | bytearray | memoryview,
    text: str,
    token_ids: Sequence[int],
    *,
    min_text_chars: int = 12,
    window: int = 4,
) -> None:
    """Raises PromptLeakError listing the first findings if the prompt is in `captured`."""
    leaks = find_prompt_leaks(
        captured, text, token_ids, min_text_chars=min_text_chars, window=window
    )
    if leaks:
        shown = "; ".join(
            f"{leak.what} at byte {leak.offset}"
            + (f", tokens {leak.tokens}" if leak.tokens else "")
            for leak in leaks[:5]
        )
        raise PromptLeakError(f"the prompt left the edge: {len(leaks)} finding(s): {shown}")


def _text_needles(text: str, min_chars: int) -> Iterator[tuple[str, bytes, None]]:
    for enc in ("utf-16-be", "utf-32-le"):
        yield f"prompt text ({enc})", text.encode(enc), None
    raw = text.encode()
    for shift in range(min(3, len(raw))):
        # Inside a larger base64 blob the text starts at some byte alignment: encode from the
        # first aligned byte and drop the last group, which mixes with whatever follows.
        tail = raw[shift:]
        yield "prompt text (base64)", base64.b64encode(tail)[:-4], None
        yield "prompt text (base64url)", base64.urlsafe_b64encode(tail)[:-4], None
    for start in range(max(1, len(text) - min_chars + 1)):
        piece = text[start : start + min_chars]
        yield "prompt text (utf-8)", piece.encode(), None
        yield "prompt text (utf-16-le)", piece.encode("utf-16-le"), None
        yield "prompt text (json-escaped)", json.dumps(piece)[1:-1].encode(), None


def _id_needles(ids: list[int], window: int) -> Iterator[tuple[str, bytes, tuple[int, int]]]:
    array = np.asarray(ids, dtype=np.int64)
    w = min(window, len(ids))
    for dtype, label in _ARRAYS.items():
        if not _fits(array, dtype):
            continue
        data, size = array.astype(dtype).tobytes(), np.dtype(dtype).itemsize
        for start in range(len(ids) - w + 1):
            yield (
                f"token ids ({label})",
                data[start * size : (start + w) * size],
                (start, start + w),
            )
    forms = {
        "msgpack ints": ([msgspec.msgpack.encode(i) for i in ids], b""),
        "decimal list": ([str(i).encode() for i in ids], b","),
        "decimal list, spaced": ([str(i).encode() for i in ids], b", "),
    }
    for label, (parts, sep) in forms.items():
        for start in range(len(ids) - w + 1):
            end = start + w
            while end < len(ids) and len(sep.join(parts[start:end])) < MIN_VARIABLE_BYTES:
                end += 1
            yield f"token ids ({label})", sep.join(parts[start:end]), (start, end)
    yield "token ids (msgpack array)", msgspec.msgpack.encode(ids), (0, len(ids))


def _fits(array: np.ndarray[tuple[int], np.dtype[np.int64]], dtype: str) -> bool:
    """Whether every id is exactly representable in `dtype`."""
    if dtype == "<f2":
        return bool(array.min() >= -2048 and array.max() <= 2048)
    if dtype == "<f4":
        return bool(abs(array).max() <= 1 << 24)
    info = np.iinfo(dtype)
    return bool(info.min <= array.min() and array.max() <= info.max)

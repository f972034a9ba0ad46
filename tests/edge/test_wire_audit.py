"""The wire audit finds the prompt in every encoding it claims to, and not in codec frames."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import msgspec
import numpy as np
import pytest

from edge import EdgeRuntime, encode
from edge.needle_search import find_all
from edge.wire_audit import PromptLeakError, assert_no_prompt_leak, find_prompt_leaks

TEXT = "My account number is 4411-2093, please summarize the attached letter."
IDS = [5, 17, 99, 1203, 48000, 7, 7, 301, 12, 64, 2, 900, 31000, 44]


def noise(n: int = 4096) -> bytes:
    return os.urandom(n)


def wrap(payload: bytes) -> bytes:
    return noise() + payload + noise()


LEAKS: list[tuple[bytes, str]] = [
    (TEXT.encode(), "prompt text (utf-8)"),
    (TEXT.encode("utf-16-le"), "prompt text (utf-16-le)"),
    (TEXT.encode("utf-16-be"), "prompt text (utf-16-be)"),
    (b'{"b64": "' + base64.b64encode(b"xy" + TEXT.encode()) + b'"}', "prompt text (base64)"),
    (TEXT[20:33].encode(), "prompt text (utf-8)"),
    (np.array(IDS, "<i4").tobytes(), "token ids (int32 little-endian)"),
    (np.array(IDS, "<i8").tobytes(), "token ids (int64 little-endian)"),
    (np.array(IDS, ">i4").tobytes(), "token ids (int32 big-endian)"),
    (np.array(IDS[5:12], "<i4").tobytes(), "token ids (int32 little-endian)"),
    (np.array(IDS, "<f4").tobytes(), "token ids (float32 little-endian)"),
    (msgspec.msgpack.encode({"prompt_token_ids": IDS}), "token ids (msgpack"),
    (msgspec.msgpack.encode(IDS[3:10]), "token ids (msgpack ints)"),
    (b"[3, 1203, 48000, 7, 7]", "token ids (decimal list, spaced)"),
    (json.dumps({"ids": IDS}).encode(), "token ids (decimal list, spaced)"),
    (json.dumps({"ids": IDS}, separators=(",", ":")).encode(), "token ids (decimal list)"),
]


@pytest.mark.parametrize(("payload", "what"), LEAKS)
def test_each_encoding_is_found(payload: bytes, what: str) -> None:
    leaks = find_prompt_leaks(wrap(payload), TEXT, IDS)
    assert any(leak.what.startswith(what) for leak in leaks), leaks
    assert all(leak.offset >= 4096 for leak in leaks)
    with pytest.raises(PromptLeakError, match="the prompt left the edge"):
        assert_no_prompt_leak(wrap(payload), TEXT, IDS)


def test_non_ascii_text_escaped_in_json() -> None:
    text = "Résumé für Zoë: 机密 " + TEXT
    payload = json.dumps({"prompt": text}).encode()  # ensure_ascii: \u00e9 escapes
    leaks = find_prompt_leaks(wrap(payload), text, [])
    assert [leak.what for leak in leaks][:1] == ["prompt text (json-escaped)"]


def test_small_ids_in_uint16_and_float16() -> None:
    ids = [3, 141, 59, 265, 358, 97, 93, 238]
    for dtype in ("<u2", "<f2"):
        leaks = find_prompt_leaks(wrap(np.array(ids, dtype).tobytes()), "", ids)
        assert leaks and leaks[0].tokens is not None


def test_needle_search_is_exact() -> None:
    data = b"abcabcXYZ" + bytes(100) + b"needle" + bytes(3)
    assert find_all(data, [b"abc", b"bca", b"needle", b"XYZ\x00", b"missing", b"", b"x" * 999]) == {
        b"abc": 0,
        b"bca": 1,
        b"needle": 109,
        b"XYZ\x00": 6,
    }
    assert find_all(b"", [b"a"]) == {}


def test_clean_random_bytes_and_short_needles() -> None:
    assert find_prompt_leaks(noise(1 << 16), TEXT, IDS) == []
    # A one-token prompt in msgpack is a single byte: too weak a needle to report.
    assert find_prompt_leaks(b"\x05" * 10, "", [5]) == []


def test_hidden_state_frames_do_not_reveal_the_prompt(tiny_llama_dir: Path) -> None:
    rt = EdgeRuntime(tiny_llama_dir, 1, max_positions=64)
    ids = [3, 141, 59, 265, 358, 97, 93, 238, 462, 64, 33, 279]
    wire = b""
    for codec in ("float16", "int8", "float32"):
        frame = encode(rt.prefill(ids[:-1]), codec)
        wire += msgspec.msgpack.encode({"type": "prefill", "hidden": frame})
        wire += msgspec.msgpack.encode({"type": "step", "hidden": encode(rt.step(ids[-1]), codec)})
    assert_no_prompt_leak(wire, "the tiny model prompt", ids)

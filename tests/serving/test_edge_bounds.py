"""What one edge message may cost the router's event loop (issue 27, "trust, second round":
/health answered within 100 ms while hostile input arrives). aiohttp assembles a WebSocket
message on the loop (three copies of it: the fragments joined, unmasked in a bytearray, made
bytes) and msgspec copies its frames once more, all holding the GIL, so a thread would not
help: a 64 MiB message held the loop 240-670 ms on a shared 2-core EPYC. The bound on one
message is therefore the HTTP API's on one body, 16 MiB, and a larger one is refused by the
length its frame announces, before any of it is read or decoded. Counted, not timed."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import WSCloseCode
from aiohttp.test_utils import TestClient, TestServer

from hetero_pd import secrets
from hetero_pd.serving.api import edge_protocol as E
from hetero_pd.serving.api.app import create_app
from hetero_pd.serving.api.state import ApiState
from hetero_pd.serving.control.auth import RouterKeys
from hetero_pd.serving.router.router import Router, RouterConfig

from .test_body_cost import Tokenizer

KEY = "edge-key"
WIDTH = 576
#: The bound a message must stay within on the router's loop (the HTTP API's on a body).
BOUND = 16 * 2**20


def frame(rows: int) -> dict[str, Any]:
    """A float16 hidden-state frame of `rows` tokens."""
    data = b"\1" * (2 * WIDTH * rows)
    return {"version": 1, "dtype": "float16", "shape": [rows, WIDTH], "scale": b"", "data": data}


def start(size: int) -> bytes:
    """A `start` message of about `size` bytes, for a model this router does not serve
    (encoded as a device that skips `pack`'s check would)."""
    prompt = frame((size - 4096) // (2 * WIDTH)) | {"outliers": 0}
    prompt |= {"outlier_index": b"", "outlier_value": b""}
    fields = {"model": "other", "split_layer": 2, "fingerprint": "f", "params": {}}
    return msgspec.msgpack.encode({"t": "start", "v": 1, **fields, "prompt": prompt})


async def _session(raw: bytes, unpacked: list[int], compress: int = 0) -> tuple[Any, ...]:
    """How the session ended: ("answer", error code, messages decoded) or ("closed", close
    code, messages decoded); and the permessage-deflate window the router agreed to."""
    router = Router(RouterConfig(), RouterKeys.from_secret(secrets.generate().encode()))
    try:
        state = ApiState(router, Tokenizer(), ["m"], 64, 100, api_keys=(KEY,))
        async with TestClient(TestServer(create_app(state))) as client:
            headers = {"Authorization": f"Bearer {KEY}"}
            connect = client.ws_connect(E.PATH, headers=headers, max_msg_size=0, compress=compress)
            async with connect as ws:
                with contextlib.suppress(ConnectionError):  # refused while it is sent
                    await ws.send_bytes(raw)
                msg = await ws.receive()
                decoded = len(unpacked)  # before this side's own unpack below
                if msg.type == aiohttp.WSMsgType.BINARY:
                    code = E.unpack(msg.data).code  # type: ignore[union-attr]
                    return ("answer", code, decoded, ws.compress)
                return ("closed", ws.close_code, decoded, ws.compress)
    finally:
        await router.close()


def unpacked_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The byte length of every edge message the session decodes from now on."""
    seen: list[int] = []
    unpack = E.unpack

    def spy(data: bytes) -> E.EdgeMessage:
        seen.append(len(data))
        return unpack(data)

    monkeypatch.setattr(E, "unpack", spy)
    return seen


@pytest.mark.timeout(120)
def test_an_edge_message_past_the_bound_is_refused_unread(monkeypatch: pytest.MonkeyPatch) -> None:
    """A message at the bound is decoded and answered (here: a model not served); one past
    it ends the session from its frame's announced length, never decoded."""
    seen = unpacked_sizes(monkeypatch)
    near = asyncio.run(asyncio.wait_for(_session(start(BOUND), seen), 100))
    assert near == ("answer", "model_not_found", 1, 0), near
    seen.clear()
    past = asyncio.run(asyncio.wait_for(_session(start(BOUND + 2 * WIDTH + 4096), seen), 100))
    # 1009 when the device reads the close; 1006 when the router dropped the connection
    # first, under the device's send of the rest of the message.
    too_big = (WSCloseCode.MESSAGE_TOO_BIG, WSCloseCode.ABNORMAL_CLOSURE)
    assert past[0] == "closed" and past[1] in too_big and past[2:] == (0, 0), past


@pytest.mark.timeout(120)
def test_an_edge_session_is_never_compressed(monkeypatch: pytest.MonkeyPatch) -> None:
    """permessage-deflate would let 16 KiB on the wire become a 16 MiB message inflated on the
    router's loop (zlib, then the same copies), for every message of a session; hidden states
    hardly compress, so the router does not agree to it: the device's offer is declined and
    its message arrives as sent."""
    seen = unpacked_sizes(monkeypatch)
    got = asyncio.run(asyncio.wait_for(_session(start(BOUND), seen, compress=15), 100))
    assert got == ("answer", "model_not_found", 1, 0), got


def test_a_device_is_told_before_it_sends_a_message_past_the_bound() -> None:
    """The device's own check (`pack`): a prompt too large for one message is refused with a
    message naming the size and what to do, not sent to be cut off."""
    prompt = frame(BOUND // (2 * WIDTH) + 1) | {"outliers": 0}
    prompt |= {"outlier_index": b"", "outlier_value": b""}
    with pytest.raises(E.ProtocolError, match="int8"):
        E.pack("start", model="m", split_layer=2, fingerprint="f", params={}, prompt=prompt)

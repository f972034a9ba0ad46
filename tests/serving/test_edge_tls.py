"""The edge link over TLS (edge.tls, on by default): a capture of the bytes between a real
EdgeClient and the router's edge listener (through a loopback proxy this test runs) holds
none of the hidden-state bytes the device sent; a bit flipped in one of its records ends
that session with a clear error and leaves the router serving; the plain port and plain
URLs refuse edge sessions unless told otherwise."""

from __future__ import annotations

import asyncio
import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import msgspec
import pytest
from aiohttp import web

from edge import EdgeClient, EdgeError, EdgeRuntime
from edge.wire_audit import assert_no_prompt_leak
from hetero_pd.deploy.testing import Stack, deployment, running_stack
from hetero_pd.serving.api.edge_protocol import PATH, pack
from hetero_pd.serving.api.edge_tls import generate

from .conftest import proxy

SPLIT = 2
KEY = "edge-key"
PROMPT = "The account number 4411-2093 belongs to Ada; summarize her last three letters."
APP_DATA = 23  # TLS record type of application data (every encrypted record in TLS 1.3)


@pytest.fixture(scope="module")
def stack(text_llama_dir: Path) -> Iterator[Stack]:
    dep = deployment(text_llama_dir, router={"api_keys": [KEY]}, edge={"split_layer": SPLIT})
    with running_stack(dep) as s:
        yield s


class Tap:
    """Keeps every byte of the edge link both ways (a loopback proxy, :func:`proxy`) and can
    flip one bit in the client's `flip`-th large encrypted record (1-based; 0: none)."""

    def __init__(self, flip: int = 0) -> None:
        self.captured = bytearray()
        self.client_bytes = bytearray()  # the device's side alone
        self.flip = flip
        self.large_records = 0
        self._pending = bytearray()

    def down(self, data: bytes) -> bytes:
        self.captured += data
        return data

    def up(self, data: bytes) -> bytes:
        """The client's bytes to forward: whole TLS records, one bit flipped if due."""
        self.captured += data
        self.client_bytes += data
        if not self.flip:
            return data
        self._pending += data
        out = bytearray()
        while len(self._pending) >= 5:
            length = int.from_bytes(self._pending[3:5], "big")
            if len(self._pending) < 5 + length:
                break
            record = bytearray(self._pending[: 5 + length])
            del self._pending[: 5 + length]
            if record[0] == APP_DATA and length >= 1024:
                self.large_records += 1
                if self.large_records == self.flip:
                    record[5 + length // 2] ^= 0x01
            out += record
        return bytes(out)

    def to(self, url: str) -> AbstractAsyncContextManager[str]:
        return proxy(url, up=self.up, down=self.down)


def _device(stack: Stack, url: str, model_dir: Path, **kw: object) -> EdgeClient:
    return EdgeClient(
        url, model_dir, SPLIT, model=stack.dep.model, api_key=KEY, ca_file=stack.edge_ca, **kw
    )


def _hidden_pieces(sent: list[bytes]) -> list[bytes]:
    """32-byte pieces of every hidden-state frame the device sent (prompt and per token)."""
    pieces = []
    for raw in sent:
        msg = msgspec.msgpack.decode(raw)
        data = (msg.get("prompt") or msg.get("frame"))["data"]
        pieces += [data[i : i + 32] for i in range(0, len(data) - 32, 32)]
    return pieces


def ws_unmasked(stream: bytes) -> bytes:
    """The payloads of a device's WebSocket frames read from its raw bytes (after the HTTP
    upgrade), unmasked: a WebSocket client XORs every frame with a random key, so a search
    of the raw bytes alone would miss plaintext hidden states. Ciphertext parses as garbage."""
    pos, out = stream.find(b"\r\n\r\n") + 4, bytearray()
    while pos > 0 and pos + 2 <= len(stream):
        n, pos = stream[pos + 1] & 0x7F, pos + 2
        if n >= 126:
            width = 2 if n == 126 else 8
            n, pos = int.from_bytes(stream[pos : pos + width], "big"), pos + width
        key, pos = stream[pos : pos + 4], pos + 4
        body = stream[pos : pos + n]
        out += bytes(b ^ key[i % 4] for i, b in enumerate(body)) if len(key) == 4 else body
        pos += n
    return bytes(out)


def _leaked(tap: Tap, sent: list[bytes]) -> list[bytes]:
    pieces = _hidden_pieces(sent)
    assert len(pieces) > 50 and all(p in b"".join(sent) for p in pieces)  # what was sent
    unmasked = ws_unmasked(bytes(tap.client_bytes))
    return [p for p in pieces if p in tap.captured or p in unmasked]


def test_the_capture_search_finds_hidden_states_sent_in_clear(text_llama_dir: Path) -> None:
    """The search below fails where it should: a plaintext session (to a stand-in cloud
    that answers one token) through the same tap shows every piece."""

    async def cloud(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=64 << 20)
        await ws.prepare(request)
        await ws.receive()
        await ws.send_bytes(pack("token", token_ids=[1], text="a", finish_reason="length"))
        await ws.close()
        return ws

    async def run(tap: Tap, sent: list[bytes]) -> None:
        app = web.Application()
        app.router.add_get(PATH, cloud)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        try:
            async with tap.to(f"http://127.0.0.1:{port}") as url:
                edge = EdgeClient(url, text_llama_dir, SPLIT, plaintext=True, tap=sent.append)
                await edge.complete(PROMPT, max_tokens=1)
        finally:
            await runner.cleanup()

    tap, sent = Tap(), []
    asyncio.run(asyncio.wait_for(run(tap, sent), 60))
    assert len(_leaked(tap, sent)) == len(_hidden_pieces(sent))


def test_a_capture_of_the_edge_link_holds_no_hidden_state_byte(
    stack: Stack, text_llama_dir: Path
) -> None:
    tap, sent = Tap(), []

    async def run() -> list[int]:
        async with tap.to(stack.edge_url) as url:
            edge = _device(stack, url, text_llama_dir, tap=sent.append)
            return (await edge.complete(PROMPT, max_tokens=6, ignore_eos=True)).token_ids

    assert len(asyncio.run(asyncio.wait_for(run(), 60))) == 6
    assert len(tap.captured) > sum(map(len, sent))  # the capture saw all of it go by
    found = _leaked(tap, sent)
    assert found == [], f"{len(found)} of {len(_hidden_pieces(sent))} hidden-state pieces in clear"
    ids = EdgeRuntime(text_llama_dir, SPLIT).tokenize(PROMPT)
    assert_no_prompt_leak(bytes(tap.captured), PROMPT, ids)
    assert_no_prompt_leak(ws_unmasked(bytes(tap.client_bytes)), PROMPT, ids)


def test_a_flipped_bit_ends_the_session_clearly_and_the_router_serves_on(
    stack: Stack, text_llama_dir: Path
) -> None:
    """The bit is flipped in the device's first large record (its start message, the
    prompt's hidden states): the router's TLS layer fails its tag and drops the
    connection; the device gets an EdgeError, the next session runs."""
    tap = Tap(flip=1)

    async def tampered() -> None:
        async with tap.to(stack.edge_url) as url:
            await _device(stack, url, text_llama_dir, retries=0).complete(PROMPT, max_tokens=4)

    with pytest.raises(EdgeError) as info:
        asyncio.run(asyncio.wait_for(tampered(), 60))
    assert tap.large_records >= 1
    assert info.value.code == "closed" and "integrity check" in str(info.value), info.value
    done = asyncio.run(_device(stack, stack.edge_url, text_llama_dir).complete("Hi", max_tokens=3))
    assert len(done.token_ids) == 3
    with urllib.request.urlopen(stack.url + "/health", timeout=30) as r:
        assert json.loads(r.read())["status"] == "ok"
    assert stack.router is not None and all(w.alive for w in stack.router.workers.values())


def test_plain_ports_and_urls_refuse_the_edge_link(stack: Stack, text_llama_dir: Path) -> None:
    with pytest.raises(EdgeError, match="insecure") as info:
        _device(stack, stack.url, text_llama_dir)
    assert "plaintext=True" in str(info.value)
    # told to go plain anyway, the API's own port refuses: it names the TLS listener
    plain = _device(stack, stack.url, text_llama_dir, plaintext=True, retries=0)
    with pytest.raises(EdgeError, match="refused"):
        asyncio.run(plain.complete("Hi", max_tokens=2))
    req = urllib.request.Request(stack.url + PATH, headers={"Authorization": f"Bearer {KEY}"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(req, timeout=30)
    assert refused.value.code == 403
    assert stack.edge_url in json.loads(refused.value.read())["error"]["message"]


def test_a_device_that_trusts_another_certificate_is_refused(
    stack: Stack, text_llama_dir: Path
) -> None:
    other = generate("127.0.0.1")  # a certificate the router does not hold
    try:
        edge = EdgeClient(
            stack.edge_url, text_llama_dir, SPLIT, model=stack.dep.model, ca_file=other.cert
        )
        with pytest.raises(EdgeError, match="tls") as info:
            asyncio.run(edge.complete("Hi", max_tokens=2))
        assert isinstance(info.value.__cause__.__cause__, ssl.SSLCertVerificationError) or (
            "CERTIFICATE_VERIFY_FAILED" in str(info.value)
        )
    finally:
        other.remove()

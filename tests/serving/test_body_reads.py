"""Bodies being read are bounded in all, not only per body: each may be 16 MiB, and a client
that opens connections and sends their bodies slowly (or never ends them) would have the
router hold every byte received so far, on every connection, until it runs out of memory.
Past the bytes allowed to be in reading at once, a body is refused before it is read."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from hetero_pd import secrets
from hetero_pd.serving.api.app import create_app
from hetero_pd.serving.api.state import ApiState
from hetero_pd.serving.control.auth import RouterKeys
from hetero_pd.serving.router.router import Router, RouterConfig

KIB = 1024


class Tokenizer:
    """Only what /detokenize reads: the vocabulary's size, and a text for the ids."""

    def __len__(self) -> int:
        return 100

    def decode(self, ids: list[int], **_: object) -> str:
        return " ".join(map(str, ids))


async def announce(client: TestClient, length: int, sent: bytes) -> asyncio.StreamWriter:
    """A POST /detokenize announcing a body of `length` bytes of which only `sent` comes;
    its connection, left open."""
    _, writer = await asyncio.open_connection(client.host, client.port)
    head = (
        "POST /detokenize HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
        f"\r\nContent-Length: {length}\r\n\r\n"
    )
    writer.write(head.encode() + sent)
    await writer.drain()
    return writer


@pytest.mark.timeout(60)
def test_bodies_in_reading_are_bounded_in_all() -> None:
    async def scenario() -> list[tuple[int, str | None, str]]:
        router = Router(RouterConfig(), RouterKeys.from_secret(secrets.generate().encode()))
        state = ApiState(router, Tokenizer(), ["m"], 64, 100)
        state.reads.limit = 1024 * KIB
        answers = []
        try:
            async with TestClient(TestServer(create_app(state))) as client:
                # a body announced at 1000 KiB, of which 900 KiB come: its read waits
                slow = await announce(client, 1000 * KIB, b"[" * (900 * KIB))
                for _ in range(500):  # until its handler holds what came (bounded: ~5 s)
                    if state.reads.reading == 900 * KIB:
                        break
                    await asyncio.sleep(0.01)
                assert state.reads.reading == 900 * KIB
                for size in (200 * KIB, KIB):  # past the bound, then within it
                    body = b'{"tokens": [1]}' + b" " * (size - 15)
                    a = await client.post("/detokenize", data=body)
                    message = await a.text()
                    answers.append((a.status, a.headers.get("Retry-After"), message))
                slow.close()
                for _ in range(500):  # its share comes back once its client is gone
                    if not state.reads.reading:
                        break
                    await asyncio.sleep(0.01)
                assert state.reads.reading == 0
                body = b'{"tokens": [1]}' + b" " * (200 * KIB - 15)
                a = await client.post("/detokenize", data=body)
                answers.append((a.status, a.headers.get("Retry-After"), ""))
        finally:
            await router.close()
        return answers

    answers = asyncio.run(asyncio.wait_for(scenario(), 50))
    status, retry_after, message = answers[0]
    assert status == 503 and retry_after is not None, answers
    assert "being read" in message and str(1024 * KIB) in message, message
    # within the bound, and once the slow one is gone, bodies are read and answered as ever
    assert answers[1][0] == 200 and answers[2][0] == 200, answers


@pytest.mark.timeout(60)
def test_a_body_announced_and_never_sent_holds_nothing() -> None:
    """A connection that announces a large body and sends none of it costs the router no
    memory, so it must not take others' share either: counting announced lengths let a few
    such connections, held open, turn every other body away."""

    async def scenario() -> int:
        router = Router(RouterConfig(), RouterKeys.from_secret(secrets.generate().encode()))
        state = ApiState(router, Tokenizer(), ["m"], 64, 100)
        state.reads.limit = 1024 * KIB
        try:
            async with TestClient(TestServer(create_app(state))) as client:
                idle = await announce(client, 1000 * KIB, b"[")
                body = b'{"tokens": [1]}' + b" " * (200 * KIB - 15)
                status = (await client.post("/detokenize", data=body)).status
                idle.close()
                return status
        finally:
            await router.close()

    assert asyncio.run(asyncio.wait_for(scenario(), 50)) == 200

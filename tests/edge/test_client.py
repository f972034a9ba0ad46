"""EdgeClient's reconnect and backoff against real sockets: a server that drops every
connection, one that answers the WebSocket upgrade with 503, one that refuses the key. The
backoff is counted through the client's `sleep` (each wait recorded, none slept), not timed.
A reconnect that then succeeds, through a proxy in front of a real stack, is in
tests/serving/test_edge_session.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from aiohttp import web

from edge import EdgeClient, EdgeError, EdgeRuntime
from hetero_pd.serving.api.edge_protocol import PATH


@pytest.fixture(scope="module")
def runtime(tiny_llama_dir: Path) -> EdgeRuntime:
    return EdgeRuntime(tiny_llama_dir, 1)


class Backoff:
    """The client's `sleep`: records each wait and returns at once."""

    def __init__(self) -> None:
        self.waits: list[float] = []

    async def sleep(self, seconds: float) -> None:
        self.waits.append(seconds)


@asynccontextmanager
async def dropping_server() -> AsyncIterator[tuple[str, list[int]]]:
    """A TCP server that closes every connection it accepts; its URL and the count."""
    accepted = [0]

    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted[0] += 1
        writer.close()

    server = await asyncio.start_server(drop, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", accepted
    finally:
        server.close()
        await server.wait_closed()


@asynccontextmanager
async def answering(status: int) -> AsyncIterator[tuple[str, list[int]]]:
    """An HTTP server answering the edge session's upgrade with `status`; URL and count."""
    upgrades = [0]

    async def session(request: web.Request) -> web.Response:
        upgrades[0] += 1
        return web.Response(status=status)

    app = web.Application()
    app.router.add_get(PATH, session)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", upgrades
    finally:
        await runner.cleanup()


async def _fail(client: EdgeClient) -> EdgeError:
    with pytest.raises(EdgeError) as info:
        await client.generate([1, 2, 3], max_tokens=2)
    return info.value


def test_dropped_connections_are_retried_with_doubling_backoff(runtime: EdgeRuntime) -> None:
    backoff = Backoff()

    async def run() -> tuple[EdgeError, int]:
        async with dropping_server() as (url, accepted):
            edge = EdgeClient(
                url, "", 1, runtime=runtime, retries=3, sleep=backoff.sleep, plaintext=True
            )
            return await _fail(edge), accepted[0]

    err, accepted = asyncio.run(asyncio.wait_for(run(), 30))
    assert err.code == "unreachable"
    # The first try and 3 retries; aiohttp itself sends an idempotent GET once more on a
    # fresh connection when the server hangs up, so each try is one or two connections.
    assert 4 <= accepted <= 8
    assert backoff.waits == [0.2, 0.4, 0.8]


def test_an_unavailable_router_is_retried_and_a_refusal_is_not(runtime: EdgeRuntime) -> None:
    async def run(status: int) -> tuple[EdgeError, int, list[float]]:
        backoff = Backoff()
        async with answering(status) as (url, upgrades):
            edge = EdgeClient(
                url, "", 1, runtime=runtime, retries=2, sleep=backoff.sleep, plaintext=True
            )
            return await _fail(edge), upgrades[0], backoff.waits

    err, upgrades, waits = asyncio.run(asyncio.wait_for(run(503), 30))
    assert (err.code, upgrades, waits) == ("unavailable", 3, [0.2, 0.4])
    assert "HTTP 503" in str(err)
    err, upgrades, waits = asyncio.run(asyncio.wait_for(run(401), 30))
    assert (err.code, upgrades, waits) == ("refused", 1, [])

"""Fixtures of the bench tests: `recorded_loads`, and `fake_server`, a TEST-ONLY stand-in
for an OpenAI-compatible streaming server.

``_FakeOpenAIServer`` gives the client's measurements a known ground truth (the real
stack's run is tests/bench/test_colocated.py).  It streams ``max_tokens`` chunks per request with
known delays (``ttft`` before the first content chunk, ``itl`` between the next ones), so
the benchmark's measurements can be checked against what the server did.  Prompts that
contain ``REJECT`` get HTTP 429, prompts that contain ``FAIL500`` get HTTP 500.  With
``serial=True`` it serves one request at a time, so latency grows with the request rate.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
from aiohttp import web


class _FakeOpenAIServer:
    def __init__(self, ttft: float, itl: float, serial: bool = False) -> None:
        self.ttft, self.itl, self.serial = ttft, itl, serial
        self.received = 0
        self.prompts: list[str] = []  # in arrival order
        self.url = ""
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._runner: web.AppRunner | None = None
        self._lock: asyncio.Lock | None = None

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> _FakeOpenAIServer:
        self._thread.start()
        if not self._ready.wait(timeout=10):
            raise RuntimeError("fake server did not start within 10 s")
        return self

    def stop(self) -> None:
        async def cleanup() -> None:
            if self._runner is not None:
                await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(cleanup(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start_site())
        self._ready.set()
        self._loop.run_forever()
        self._loop.close()

    async def _start_site(self) -> None:
        self._lock = asyncio.Lock()
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"

    # -- handlers ----------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=True)

    async def _handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        self.received += 1
        body = await request.json()
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        self.prompts.append(prompt)
        if "REJECT" in prompt:
            err = {"message": "server overloaded", "type": "overloaded", "code": 429}
            return web.json_response({"error": err}, status=429)
        if "FAIL500" in prompt:
            err = {"message": "boom", "type": "internal", "code": 500}
            return web.json_response({"error": err}, status=500)
        assert self._lock is not None
        if self.serial:
            async with self._lock:
                return await self._stream(request, body, chat)
        return await self._stream(request, body, chat)

    async def _stream(
        self, request: web.Request, body: dict[str, Any], chat: bool
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(obj: Any) -> None:
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        n = int(body["max_tokens"])
        obj = "chat.completion.chunk" if chat else "text_completion"
        if chat:  # OpenAI opens a chat stream with a role-only delta: not a token
            await send({"object": obj, "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        for i in range(n):
            await asyncio.sleep(self.ttft if i == 0 else self.itl)
            choice: dict[str, Any] = {"index": 0, "finish_reason": None}
            if chat:
                choice["delta"] = {"content": f" tok{i}"}
            else:
                choice["text"] = f" tok{i}"
            await send({"object": obj, "choices": [choice]})
        last: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        last.update({"delta": {}} if chat else {"text": ""})
        await send({"object": obj, "choices": [last]})
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": n + 7}
            await send({"object": obj, "choices": [], "usage": usage})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@pytest.fixture
def fake_server() -> Iterator[Callable[..., _FakeOpenAIServer]]:
    """Factory: ``fake_server(ttft=0.1, itl=0.02, serial=False)`` -> a started server."""
    servers: list[_FakeOpenAIServer] = []

    def make(ttft: float = 0.1, itl: float = 0.02, serial: bool = False) -> _FakeOpenAIServer:
        server = _FakeOpenAIServer(ttft, itl, serial).start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.stop()


@pytest.fixture
def recorded_loads(monkeypatch: pytest.MonkeyPatch) -> Callable[[ModuleType], list[int]]:
    """``recorded_loads(bench_module)`` -> the list of N its ``background_load(N)`` was
    called with; no busy process starts: on a two-core CI box they would only slow the
    smoke tests down (tests/bench/test_background.py runs the real ones)."""

    def patch(module: ModuleType) -> list[int]:
        calls: list[int] = []

        @contextlib.contextmanager
        def recorded(n: int, *args: Any, **kwargs: Any) -> Iterator[list[int]]:
            calls.append(n)
            yield []

        monkeypatch.setattr(module, "background_load", recorded)
        return calls

    return patch

"""/health while a worker is replaced: the router keeps it listed, with its role, until the
replacement says hello (it was missing while the old handle closed, then listed as role
"unknown" until the new process answered)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from hetero_pd import secrets
from hetero_pd.serving.api.app import create_app
from hetero_pd.serving.api.state import ApiState
from hetero_pd.serving.control import protocol as P
from hetero_pd.serving.control import values as V
from hetero_pd.serving.control.auth import RouterKeys, WorkerKeys
from hetero_pd.serving.control.server import ControlServer
from hetero_pd.serving.router.router import Router, RouterConfig


class StandIn:
    """A worker's control endpoint (real CurveZMQ socket) that answers hello only once
    `answering` is set, as a new process does once its model is loaded; it answers check
    as an idle worker, counts the aborts it reads, and reads nothing while `reading` is
    cleared (a slow or far worker)."""

    def __init__(self, keys: WorkerKeys, answering: bool) -> None:
        self.server = ControlServer("127.0.0.1", 0, keys)
        self.address = f"tcp://127.0.0.1:{self.server.port}"
        self.answering = threading.Event()
        if answering:
            self.answering.set()
        self.reading = threading.Event()
        self.reading.set()
        self.aborts = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        info = V.WorkerInfo(address=self.address, max_model_len=64)
        hellos: list[bytes] = []
        try:
            while not self.stop.is_set():
                if not self.reading.wait(0.02):
                    continue
                if self.server.poll(20):
                    for ident, msg in self.server.receive():
                        if isinstance(msg, P.Hello):
                            hellos.append(ident)
                        elif isinstance(msg, P.Check):
                            idle = P.Integrity(ok=True, used_blocks=0, message="idle")
                            self.server.send(ident, idle)
                        elif isinstance(msg, P.Abort):
                            self.aborts += 1
                if self.answering.is_set():
                    for ident in hellos:
                        ready = P.Ready(worker="decode-0", role="decode", info=info)
                        self.server.send(ident, ready)
                    hellos.clear()
                    self.server.broadcast(P.Heartbeat(worker="decode-0", load=V.WorkerLoad()))
                self.server.flush()
        finally:
            self.server.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


async def _scenario(secret: bytes, first: StandIn, second: StandIn) -> list[Any]:
    router = Router(RouterConfig(heartbeat_timeout_s=5.0), RouterKeys.from_secret(secret))
    seen: list[Any] = []
    try:
        await router.add_worker("decode-0", first.address, timeout_s=20)
        state = ApiState(router, None, ["m"], 64, 100)
        async with TestClient(TestServer(create_app(state))) as client:
            replacing = asyncio.create_task(router.add_worker("decode-0", second.address, 20))
            while not replacing.done():  # one look per turn of the loop, and over HTTP
                seen.append(
                    router.workers.get("decode-0", None) and router.workers["decode-0"].role
                )
                if len(seen) % 50 == 1:
                    body = await (await client.get("/health")).json()
                    seen.append(body["workers"].get("decode-0", {}).get("role"))
                if len(seen) > 400:
                    second.answering.set()  # the new process is ready
                await asyncio.sleep(0)
            await replacing
            body = await (await client.get("/health")).json()
            seen.append(body["workers"]["decode-0"]["role"])
    finally:
        await router.close()
    return seen


def test_a_worker_being_replaced_stays_listed_with_its_role() -> None:
    secret = secrets.generate().encode()
    keys = WorkerKeys.from_secret(secret, "decode-0")
    first, second = StandIn(keys, answering=True), StandIn(keys, answering=False)
    try:
        seen = asyncio.run(asyncio.wait_for(_scenario(secret, first, second), 60))
    finally:
        first.close()
        second.close()
    assert len(seen) > 400 and set(seen) == {"decode"}, sorted(set(map(str, seen)))

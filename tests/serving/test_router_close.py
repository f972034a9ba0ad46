"""The router's last messages reach the workers: on several hosts the workers outlive the
router, and the aborts of the requests a shutdown cut are sent just before it closes its
sockets, which dropped (LINGER 0) whatever they had not sent yet: 2,000-10,500 of 20,000
aborts reached a worker that read slowly. Now the router waits for a round trip first."""

from __future__ import annotations

import asyncio
import time

from hetero_pd import secrets
from hetero_pd.serving.control import protocol as P
from hetero_pd.serving.control.auth import RouterKeys, WorkerKeys
from hetero_pd.serving.router.router import Router, RouterConfig

from .test_health_replacement import StandIn

ABORTS = 20_000  # with long ids: several times what loopback's socket buffers held (2,000-8,500)
RID = "r" * 200


async def _abort_then_close(secret: bytes, worker: StandIn) -> None:
    router = Router(RouterConfig(heartbeat_timeout_s=5.0), RouterKeys.from_secret(secret))
    try:
        await router.add_worker("decode-0", worker.address, timeout_s=20)
        client = router.workers["decode-0"]
        worker.reading.clear()  # slow (or far away): what is sent waits in buffers
        for i in range(ABORTS):  # the aborts of the requests a shutdown cut
            client.try_send(P.Abort(rid=f"{RID}{i}"))
    finally:
        # The worker reads again a moment after the router starts closing.
        asyncio.get_running_loop().call_later(0.5, worker.reading.set)
        await router.close(flush_s=30)  # as serve() closes it towards workers it did not start


def test_aborts_sent_before_the_router_closes_all_reach_the_worker() -> None:
    secret = secrets.generate().encode()
    worker = StandIn(WorkerKeys.from_secret(secret, "decode-0"), answering=True)
    try:
        asyncio.run(asyncio.wait_for(_abort_then_close(secret, worker), 60))
        # The router has closed: what it sent is read by now (or lost); the count settles.
        deadline = time.monotonic() + 5
        while worker.aborts < ABORTS and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        worker.close()
    assert worker.aborts == ABORTS

"""How serving uses the transfer engine's leases and health, without a model: a prefill
worker renews the decode worker's reservation only while the prompt waits or computes, and
the router routes nothing to a worker whose heartbeat says its transfer engine is dead."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import replace
from typing import Any

import pytest

from hetero_pd import secrets
from hetero_pd.serving.control import protocol as P
from hetero_pd.serving.control import values as V
from hetero_pd.serving.control.auth import RouterKeys, WorkerKeys
from hetero_pd.serving.control.server import ControlServer
from hetero_pd.serving.router.router import Router, RouterConfig
from hetero_pd.serving.worker.prefill_push import PushTracker
from transfer import RemoteBlocks, TransferHandle


class RecordingTransfer:
    """Stands in for TransferEngine: records renewals; pushes stay in flight."""

    def __init__(self) -> None:
        self.renewed: list[tuple[str, str, int]] = []

    def renew_remote(self, peer: str, blocks: RemoteBlocks) -> None:
        self.renewed.append((peer, blocks.request_id, blocks.epoch))

    def push_blocks(self, peer: str, src: list[int], dest: RemoteBlocks, **kw: Any) -> Any:
        return TransferHandle(f"push/{dest.request_id}", "push", peer, dest.request_id)


class HeldPrompts:
    """Stands in for LLMEngine: every prompt holds blocks 1 and 2 (20 tokens)."""

    class config:
        start_layer = 0
        block_size = 16

    class model_config:
        num_layers = 3

    def held_blocks(self, rid: str) -> tuple[list[int], int]:
        return [1, 2], 20


def test_reservations_are_renewed_until_their_push_starts() -> None:
    transfer = RecordingTransfer()
    tracker = PushTracker(transfer, HeldPrompts(), lambda *a: None)  # type: ignore[arg-type]
    tracker.expect("a", "decode-0", RemoteBlocks("a", 3, (5, 6)))
    tracker.expect("b", "decode-1", RemoteBlocks("b", 4, (7, 8)))
    tracker.renew_reservations()
    assert transfer.renewed == [("decode-0", "a", 3), ("decode-1", "b", 4)]
    tracker.prefill_finished("a", first_token=9)  # a's KV is being pushed now
    transfer.renewed.clear()
    tracker.renew_reservations()
    assert transfer.renewed == [("decode-1", "b", 4)]


class FakeWorker:
    """A worker's control endpoint (real socket, real CurveZMQ) that answers hello and
    sends heartbeats saying whether its transfer engine is healthy."""

    def __init__(self, keys: WorkerKeys) -> None:
        self.server = ControlServer("127.0.0.1", 0, keys)
        self.healthy = True
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        info = V.WorkerInfo(address="", transfer_address="tcp://127.0.0.1:9")
        try:
            while not self.stop.is_set():
                if self.server.poll(20):
                    for ident, msg in self.server.receive():
                        if isinstance(msg, P.Hello):
                            ready = P.Ready(worker="decode-9", role="decode", info=info)
                            self.server.send(ident, ready)
                load = V.WorkerLoad(transfer_healthy=self.healthy)
                self.server.broadcast(P.Heartbeat(worker="decode-9", load=load))
                self.server.flush()
        finally:
            self.server.close()


def test_no_request_goes_to_a_worker_whose_transfer_engine_is_dead() -> None:
    secret = secrets.generate().encode()
    worker = FakeWorker(WorkerKeys.from_secret(secret, "decode-9"))

    async def run() -> None:
        router = Router(RouterConfig(heartbeat_timeout_s=5.0), RouterKeys.from_secret(secret))
        try:
            await router.add_worker("decode-9", f"tcp://127.0.0.1:{worker.server.port}", 10.0)

            async def until(live: bool) -> None:
                deadline = time.monotonic() + 10
                while bool(router.live("decode")) != live:
                    assert time.monotonic() < deadline, f"live should be {live}"
                    await asyncio.sleep(0.01)

            await until(True)
            worker.healthy = False
            await until(False)
            assert not router.workers["decode-9"].load.transfer_healthy
            worker.healthy = True
            await until(True)
        finally:
            await router.close()

    try:
        asyncio.run(asyncio.wait_for(run(), 30))
    finally:
        worker.stop.set()
        worker.thread.join(5)


def test_a_worker_advertises_its_host_for_transfers_and_links_only_under_pair_keys() -> None:
    """Bound to 0.0.0.0 (a pod), a worker's transfer engine advertises the worker's
    reachable name for its link and data channel, and links only under the pair keys the
    router gives it: nothing from the worker's credential (every worker holds the same)
    nor the deployment secret, and no secret it shares with every peer"""
    from hetero_pd.config import EngineConfig
    from hetero_pd.serving.worker.config import WorkerConfig, transfer_config
    from transfer import TransferConfig

    secret = secrets.generate().encode()
    cfg = WorkerConfig(
        "decode-0",
        "decode",
        EngineConfig.from_kwargs(model="unused"),
        TransferConfig(host="0.0.0.0"),
        host="0.0.0.0",
        advertise_host="decode-0.pd.svc",
    )
    t = transfer_config(cfg)
    assert t.advertise_host == "decode-0.pd.svc" and t.require_secret
    assert t.per_peer_secrets and t.secret == b""
    credential = secrets.WorkerCredential.for_worker(secret, "decode-0")
    with pytest.raises(secrets.SecretError, match="transfer"):
        credential.key("transfer")
    own = replace(cfg, transfer=TransferConfig(host="0.0.0.0", advertise_host="10.0.0.7"))
    assert transfer_config(own).advertise_host == "10.0.0.7"
    with pytest.raises(secrets.SecretError):
        secrets.WorkerCredential.for_worker(b"", "decode-0")

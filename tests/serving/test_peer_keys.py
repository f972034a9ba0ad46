"""The router hands each worker the transfer key of every peer a message asks it to move KV
with, ahead of that message on the same socket: a key only the two workers (and the
router) hold, so a worker's transfer engine links with each peer under its own pair key."""

from __future__ import annotations

import asyncio
import time
import typing
from typing import Any

import pytest
import zmq.asyncio
from zmq.utils import monitor

from hetero_pd import SamplingParams, secrets
from hetero_pd.serving.control import migration as M
from hetero_pd.serving.control import protocol as P
from hetero_pd.serving.control import values as V
from hetero_pd.serving.control.auth import RouterKeys, WorkerKeys
from hetero_pd.serving.control.server import ControlServer
from hetero_pd.serving.router.worker_client import WorkerClient
from transfer import RemoteBlocks

PARAMS = P.WireParams.of(SamplingParams(max_tokens=4))
BLOCKS = RemoteBlocks("r", 1, (0, 1), "kv")
PULL = V.PrefixSource(peer="holder", address="tcp://127.0.0.1:1", blocks=BLOCKS, tokens=32)
#: Fields of a router -> worker message that name another worker.
PEER_FIELDS = {"writer", "reader", "dest_worker_id", "pull"}


def _messages() -> dict[type[Any], tuple[Any, list[str]]]:
    """One message of each kind that names peers, and the peers it names."""
    fields: dict[str, Any] = {"rid": "r", "prompt_ids": [1, 2], "params": PARAMS}
    prefill = {"dest_address": "tcp://127.0.0.1:2", "dest_blocks": BLOCKS}
    return {
        P.Generate: (P.Generate(**fields, pull=PULL), ["holder"]),
        P.Reserve: (P.Reserve(**fields, writer="p"), ["p"]),
        P.Prefill: (P.Prefill(**fields, **prefill, dest_worker_id="d", pull=PULL), ["d", "holder"]),
        P.OfferPrefix: (P.OfferPrefix(rid="r", prompt_ids=[1], reader="d", lease_s=1.0), ["d"]),
        M.MigrateIn: (M.MigrateIn(**fields, writer="a", num_tokens=2), ["a"]),
        M.MigrateOut: (M.MigrateOut(rid="r", dest_worker_id="b", **prefill), ["b"]),
    }


def test_named_peers_covers_every_message_that_names_a_worker() -> None:
    """A new message with a field naming a worker must be added to `named_peers`, or its
    worker would get no key for that peer and every link with it would be refused."""
    naming = {
        cls for cls in typing.get_args(P.ToWorker) if PEER_FIELDS & set(cls.__struct_fields__)
    }
    cases = _messages()
    assert naming == set(cases)
    for msg, peers in cases.values():
        assert P.named_peers(msg) == peers, msg
    assert P.named_peers(P.Generate(rid="r", prompt_ids=[1], params=PARAMS)) == []
    assert P.named_peers(P.Abort(rid="r")) == []


def test_the_router_sends_each_peers_pair_key_ahead_of_the_message() -> None:
    secret = secrets.generate().encode()
    server = ControlServer("127.0.0.1", 0, WorkerKeys.from_secret(secret, "w"))
    keys = RouterKeys.from_secret(secret)
    got: list[Any] = []

    async def run() -> None:
        ctx = zmq.asyncio.Context()
        address = f"tcp://127.0.0.1:{server.port}"
        client = WorkerClient("w", address, ctx, keys, lambda *a: None, lambda *a: None)
        try:
            client.send(P.Hello())  # as start() does: a worker hears only routers that did
            for msg, _ in _messages().values():
                client.send(msg)
            client.send(P.Reserve(rid="self", prompt_ids=[1], params=PARAMS, writer="w"))
            client.send(P.Abort(rid="r"))
            deadline = time.monotonic() + 10
            while len(got) < 1 + 2 * len(_messages()) + 2:
                assert time.monotonic() < deadline, got
                if server.poll(20):
                    got.extend(msg for _, msg in server.receive())
                await asyncio.sleep(0)
        finally:
            client.sock.close()
            ctx.term()

    try:
        asyncio.run(asyncio.wait_for(run(), 20))
    finally:
        server.close()
    expected: list[Any] = []
    for msg, peers in _messages().values():
        pairs = [P.PeerKey(peer=peer, key=keys.link_key("w", peer)) for peer in peers]
        expected += [P.PeerKeys(keys=pairs), msg]
    self_reserve = P.Reserve(rid="self", prompt_ids=[1], params=PARAMS, writer="w")
    assert got == [P.Hello(), *expected, self_reserve, P.Abort(rid="r")]
    # k(p, d) is what d is given for p, and nobody else's key
    assert keys.link_key("p", "d") == keys.link_key("d", "p") != keys.link_key("p", "x")
    root = secrets.pair_root(secret)
    assert secrets.pair_key(root, "a/b", "c") != secrets.pair_key(root, "a", "b/c")


@pytest.mark.timeout(60)
def test_an_endpoint_with_only_worker_material_gets_no_workers_pair_keys() -> None:
    """A process holding another worker's material (a compromised decode-0) that the
    router reaches at worker "decode-1"'s address (its port taken after decode-1 exited:
    the router greets a down worker's address again until a Ready comes back) must not
    complete the router's CurveZMQ handshake as decode-1, or it is sent decode-1's pair
    keys (k(decode-1, prefill-0) here) and links with prefill-0 as decode-1. The router
    checks each worker's control endpoint against that worker's own key."""
    secret = secrets.generate().encode()
    impostor = ControlServer("127.0.0.1", 0, WorkerKeys.from_secret(secret, "decode-0"))
    keys = RouterKeys.from_secret(secret)
    got: list[Any] = []
    events: list[int] = []

    async def run() -> None:
        ctx = zmq.asyncio.Context()
        address = f"tcp://127.0.0.1:{impostor.port}"
        client = WorkerClient("decode-1", address, ctx, keys, lambda *a: None, lambda *a: None)
        done = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        # a server with another key cannot read the client's HELLO: it drops the connection
        done |= zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_DISCONNECTED
        monitor = client.sock.get_monitor_socket(done)
        try:
            client.send(P.Reserve(rid="r", prompt_ids=[1], params=PARAMS, writer="prefill-0"))
            deadline = time.monotonic() + 20
            while not events or (events[-1] & zmq.EVENT_HANDSHAKE_SUCCEEDED and not got):
                assert time.monotonic() < deadline, (events, got)
                if impostor.poll(20):
                    got.extend(msg for _, msg in impostor.receive())
                if await monitor.poll(0):
                    events.append(_event(await monitor.recv_multipart()))
                await asyncio.sleep(0)
        finally:
            client.sock.disable_monitor()
            monitor.close()
            client.sock.close()
            ctx.term()

    try:
        asyncio.run(asyncio.wait_for(run(), 30))
    finally:
        impostor.close()
    assert got == [] and not events[-1] & zmq.EVENT_HANDSHAKE_SUCCEEDED, (events, got)


def _event(frames: list[bytes]) -> int:
    """The event number of a monitor message (`zmq.utils.monitor.parse_monitor_message`)."""
    event: int = monitor.parse_monitor_message(frames)["event"]
    return event

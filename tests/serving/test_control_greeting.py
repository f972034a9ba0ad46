"""A worker's control endpoint takes a router as its own only once that router greets this
process (hello): a router's DEALER socket reconnects by itself to a new process at the
address it knew and delivers what it had queued for the old one."""

from __future__ import annotations

import time

import zmq

from hetero_pd import secrets
from hetero_pd.serving.control import protocol as P
from hetero_pd.serving.control import values as V
from hetero_pd.serving.control.auth import RouterKeys, WorkerKeys, secure_client
from hetero_pd.serving.control.server import ControlServer


def test_a_new_process_heartbeats_only_to_a_router_that_greeted_it() -> None:
    """Seen in the multi-host drill: decode-0 killed and replaced within the router's
    heartbeat timeout read an Abort the router had queued for the dead process, took the
    router as its own and heartbeated to it; the router then saw "decode-0" alive again
    with the dead process's pid, role and cache, and no Ready ever updated them. Frames
    from a router that has not said hello are dropped (and counted); its hello is what
    makes it this process's router, so the first frame it reads is the Ready answer."""
    secret = secrets.generate().encode()
    server = ControlServer("127.0.0.1", 0, WorkerKeys.from_secret(secret, "w"))
    ctx = zmq.Context()
    client = ctx.socket(zmq.DEALER)
    secure_client(client, RouterKeys.from_secret(secret), "w")
    client.connect(f"tcp://127.0.0.1:{server.port}")
    codec = P.worker_codec()
    try:
        client.send(codec.encode(P.Abort(rid="queued-for-the-old-process")))
        deadline = time.monotonic() + 30
        while not server.poll(50):  # until the abort is there to read
            assert time.monotonic() < deadline, "the abort never arrived"
        assert list(server.receive()) == [] and server.routers == set()
        assert server.ungreeted == 1
        server.broadcast(P.Heartbeat(worker="w", load=V.WorkerLoad()))  # to nobody
        server.flush()
        client.send(codec.encode(P.Hello()))
        got: list[tuple[bytes, object]] = []
        while not got:
            assert time.monotonic() < deadline, "the hello never arrived"
            if server.poll(50):
                got = list(server.receive())
        ((ident, msg),) = got
        assert isinstance(msg, P.Hello) and server.routers == {ident}
        ready = P.Ready(worker="w", role="decode", info=V.WorkerInfo(max_model_len=64))
        server.send(ident, ready)
        server.broadcast(P.Heartbeat(worker="w", load=V.WorkerLoad()))
        server.flush()
        assert client.poll(30_000), "nothing came back after the hello"
        first = P.router_codec().decode(client.recv())
        assert isinstance(first, P.Ready), first  # no heartbeat went out before it
        assert client.poll(30_000)
        assert isinstance(P.router_codec().decode(client.recv()), P.Heartbeat)
    finally:
        client.close()
        ctx.term()
        server.close()

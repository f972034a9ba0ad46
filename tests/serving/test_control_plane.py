"""The control plane obeys only the deployment: a process that does not hold the secret gets
no answer and no KV block from any worker port; frames are never dropped silently; a
hostile frame cannot grow a process's memory; the secret never appears on a command line."""

from __future__ import annotations

import asyncio
import os
import time
import tracemalloc
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from hetero_pd import SamplingParams, secrets
from hetero_pd.deploy.testing import Stack
from hetero_pd.serving.api import edge_protocol as E
from hetero_pd.serving.control import protocol as P
from hetero_pd.serving.control import values as V
from hetero_pd.serving.control.auth import RouterKeys, WorkerKeys, secure_client
from hetero_pd.serving.control.server import ControlServer
from transfer import (
    KVRegion,
    RemoteBlocks,
    StatusCode,
    TransferConfig,
    TransferEngine,
    TransferError,
    TransferState,
)
from transfer.messages import Error as LinkRefused
from transfer.testing import hostile_link

from .test_transfer_grants import SecondRouter

PARAMS = P.WireParams.of(SamplingParams(max_tokens=4))


def intruder_frames() -> list[bytes]:
    """What an outsider would send: a hello, a reservation of most of the cache, a free
    generation, a prefill pushing KV to an address of its choosing."""
    blocks = RemoteBlocks("x", 1, (0, 1, 2), "kv")
    codec = P.worker_codec()
    return [
        codec.encode(P.Hello()),
        *(
            codec.encode(P.Reserve(rid=f"r{i}", prompt_ids=[1] * 900, params=PARAMS, writer="p"))
            for i in range(20)
        ),
        codec.encode(P.Generate(rid="g", prompt_ids=[1, 2, 3], params=PARAMS)),
        codec.encode(
            P.Prefill(
                rid="p",
                prompt_ids=[1, 2, 3],
                params=PARAMS,
                dest_worker_id="decode-0",
                dest_address="tcp://127.0.0.1:1",
                dest_blocks=blocks,
            )
        ),
    ]


@pytest.fixture(scope="module")
def stack(tiny_pd_stack: Stack) -> Stack:
    return tiny_pd_stack


def heartbeat_after(stack: Stack, worker: str, since: float) -> V.WorkerLoad:
    """The worker's load from a heartbeat newer than `since`."""
    assert stack.router is not None
    client = stack.router.workers[worker]
    deadline = time.monotonic() + 20
    while client.last_seen <= since:
        assert time.monotonic() < deadline, f"{worker} sent no heartbeat"
        time.sleep(0.05)
    return client.load


def test_an_outsider_is_neither_answered_nor_obeyed(stack: Stack) -> None:
    assert stack.router is not None
    workers = {w.worker_id: w.address for w in stack.router.workers.values()}
    start = time.monotonic()
    before = {worker_id: heartbeat_after(stack, worker_id, start) for worker_id in workers}
    wrong = RouterKeys.from_secret(secrets.generate().encode())
    ctx = zmq.Context()
    answered: dict[str, list[bytes]] = {}
    try:
        socks = []
        for worker_id, address in workers.items():
            bare = ctx.socket(zmq.DEALER)  # no CURVE at all
            forged = ctx.socket(zmq.DEALER)  # CURVE with keys from another secret
            secure_client(forged, wrong, worker_id)
            for sock in (bare, forged):
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(address)
                for frame in intruder_frames():
                    try:
                        sock.send(frame, zmq.NOBLOCK)
                    except zmq.Again:
                        break  # the worker already refused the handshake: no pipe is left
                socks.append((worker_id, sock))
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            for worker_id, sock in socks:
                if sock.poll(10):
                    answered.setdefault(worker_id, []).append(sock.recv())
    finally:
        ctx.destroy(linger=0)
    assert answered == {}
    now = time.monotonic()
    for worker_id in workers:
        load = heartbeat_after(stack, worker_id, now)
        assert load.frames_rejected >= before[worker_id].frames_rejected + 2, (worker_id, load)
        assert load.free_blocks == before[worker_id].free_blocks, (worker_id, load)
        assert load.waiting == load.running == load.remote == 0, (worker_id, load)
    rejected = stack.metric(
        "hetero_pd_worker_control_frames_rejected", worker="decode-0", role="decode"
    )
    assert rejected >= 2
    stack.wait_idle()


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in raw if b"=" in e)


def test_a_worker_cannot_act_as_the_router(stack: Stack) -> None:
    """A compromised worker holds what its environment gives it: never the deployment
    secret (the router's control key derives from it), and none of its own keys completes
    the router's handshake with another worker: no frame of it is answered or obeyed."""
    assert stack.launcher is not None and stack.router is not None
    env = _environ(stack.launcher.pids()["prefill-0"])
    assert secrets.ENV not in env, "a worker was given the deployment secret"
    credential = secrets.WorkerCredential.parse(env[secrets.WORKER_ENV])
    assert (credential.scope, credential.name) == ("worker", "prefill-0")  # its own, no other
    held = WorkerKeys.of(credential)
    decode = stack.router.workers["decode-0"]
    before = heartbeat_after(stack, "decode-0", time.monotonic())
    ctx = zmq.Context()
    answers = []
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # decode-0's public key (public: assume the intruder knows it), its own key pair
        sock.curve_serverkey = stack.router.keys.worker_public("decode-0")
        sock.curve_publickey = held.server_public  # the only key pair a worker has
        sock.curve_secretkey = held.server_secret
        sock.connect(decode.address)
        for frame in intruder_frames():
            try:
                sock.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                break
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            if sock.poll(10):
                answers.append(sock.recv())
    finally:
        ctx.destroy(linger=0)
    assert answers == []
    after = heartbeat_after(stack, "decode-0", time.monotonic())
    assert after.frames_rejected >= before.frames_rejected + 1
    assert after.free_blocks == before.free_blocks and after.waiting == after.running == 0
    stack.wait_idle()


def test_a_worker_cannot_link_as_another_worker(stack: Stack) -> None:
    """A compromised worker (prefill-0: the credential in its environment, and the pair key
    the router gave it for decode-0) poses as prefill-1, a worker decode-0 was told to take
    KV from: with whatever key it holds, decode-0 refuses its transfer handshake
    (AUTH_FAILED, counted in decode-0's heartbeat), so it never reaches the blocks reserved
    for prefill-1. The transfer key its material would give (what every worker once shared)
    links with no one."""
    assert stack.launcher is not None and stack.router is not None
    env = _environ(stack.launcher.pids()["prefill-0"])
    credential = secrets.WorkerCredential.parse(env[secrets.WORKER_ENV])
    shared = secrets.derive(credential.material, "transfer")  # as the shared key was made
    decode = stack.router.workers["decode-0"]
    address = decode.info.transfer_address
    before = heartbeat_after(stack, "decode-0", time.monotonic())
    refused = hostile_link(address, "prefill-1", shared)
    assert isinstance(refused, LinkRefused) and refused.status is StatusCode.AUTH_FAILED
    keys = RouterKeys.from_secret(stack.launcher.secret)
    held = [shared, keys.link_key("prefill-0", "decode-0")]
    router = SecondRouter(decode.address, stack.launcher.secret, "decode-0")
    try:  # decode-0 now holds prefill-1's pair key, and blocks only prefill-1 may write
        prompt = list(range(1, 40))
        keyed = P.PeerKeys(
            keys=[P.PeerKey(peer="prefill-1", key=keys.link_key("decode-0", "prefill-1"))]
        )
        router.sock.send(P.worker_codec().encode(keyed))
        reserve = P.Reserve(rid="for-p1", prompt_ids=prompt, params=PARAMS, writer="prefill-1")
        dest = router.ask(reserve, P.Reserved).blocks
        for key in held:
            refused = hostile_link(address, "prefill-1", key)
            assert isinstance(refused, LinkRefused), refused
            assert refused.status is StatusCode.AUTH_FAILED, refused
            insider = TransferEngine(
                "prefill-1",
                "prefill",
                TransferConfig(
                    per_peer_secrets=True, transports=("tcp",), link_timeout_s=2.0, timeout_s=4.0
                ),
            )
            try:
                insider.register_region(KVRegion.allocate("kv", 1, decode.info.num_blocks, (4,)))
                insider.trust("decode-0", key)
                with pytest.raises(TransferError) as info:
                    insider.link("decode-0", address)
                assert info.value.code is StatusCode.AUTH_FAILED
                push = insider.push_blocks("decode-0", list(dest.block_ids), dest, transport="tcp")
                assert push.wait(10) is TransferState.FAILED
            finally:
                insider.close()
        router.sock.send(P.worker_codec().encode(P.Abort(rid="for-p1")))
    finally:
        router.close()
    after = heartbeat_after(stack, "decode-0", time.monotonic())
    assert after.transfer_auth_failures >= before.transfer_auth_failures + 1 + len(held)
    for name, counters in after.transfer.items():
        assert (
            counters.transfers_received_total
            == before.transfer.get(name, V.TransportCounters()).transfers_received_total
        ), name
    stack.wait_idle()


def test_the_secret_is_never_on_a_command_line(stack: Stack) -> None:
    assert stack.launcher is not None
    for pid in stack.launcher.pids().values():
        argv = Path(f"/proc/{pid}/cmdline").read_bytes()
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        secret = next(e for e in env if e.startswith(secrets.WORKER_ENV.encode() + b"="))
        assert len(secret) > len(secrets.WORKER_ENV) + 16
        assert secret.split(b"=", 1)[1] not in argv


def test_worker_threads_spin_only_briefly(stack: Stack) -> None:
    """Idle OpenMP threads spin briefly, then sleep, rather than holding a core another
    worker or process needs; the launcher says so in each worker's environment."""
    assert stack.launcher is not None and len(stack.launcher.pids()) > 1
    for pid in stack.launcher.pids().values():
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert b"GOMP_SPINCOUNT=30000" in env


def test_a_router_that_stops_reading_loses_no_frame() -> None:
    """A ROUTER socket once dropped 8,036 of 20,000 frames at its high-water mark without
    an error; now a full pipe queues them, and they all arrive, in order, once read."""
    secret = secrets.generate().encode()
    server = ControlServer("127.0.0.1", 0, WorkerKeys.from_secret(secret, "w"))
    ctx = zmq.Context()
    client = ctx.socket(zmq.DEALER)
    secure_client(client, RouterKeys.from_secret(secret), "w")
    client.setsockopt(zmq.RCVHWM, 100)
    client.connect(f"tcp://127.0.0.1:{server.port}")
    try:
        client.send(P.worker_codec().encode(P.Hello()))
        ident = b""
        deadline = time.monotonic() + 10
        while not ident:
            assert time.monotonic() < deadline
            if server.poll(50):
                ident = next(iter(server.receive()))[0]
        n = 20_000
        for i in range(n):
            server.send(ident, P.Output(rid="r", seq=i, text="x" * 64, token_ids=[i % 500]))
        codec, got = P.router_codec(), []
        deadline = time.monotonic() + 60
        while len(got) < n and time.monotonic() < deadline:
            server.flush()
            while client.poll(0):
                got.append(codec.decode(client.recv()).seq)
        assert got == list(range(n))
        assert server.lost() == []
    finally:
        client.close()
        ctx.term()
        server.close()


def _peak_bytes(decode: Any, frame: bytes) -> int:
    tracemalloc.start()
    try:
        with pytest.raises(ValueError):
            decode(frame)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_hostile_frame_cannot_amplify_memory() -> None:
    """A 4 MiB msgpack array of empty maps once grew a worker by 289 MiB: decoding built
    every map before looking at it. Typed decoding refuses it at its first element."""
    flood = msgspec.msgpack.encode([{}] * (4 * 2**20))
    deep = b"\x91" * 100_000 + b"\xc0"  # arrays nested 100,000 deep
    for decode in (P.worker_codec().decode, P.router_codec().decode, E.unpack):
        for frame in (flood, deep):
            assert _peak_bytes(decode, frame) < 2**20, decode


def test_decoding_a_hostile_map_is_bounded() -> None:
    big = {"v": 2, "t": "generate", "rid": "r", "params": {}, "prompt_ids": [1] * (2**21)}
    with pytest.raises(V.MessageError, match="prompt_ids"):
        P.worker_codec().decode(msgspec.msgpack.encode(big))
    params = msgspec.structs.asdict(PARAMS) | {"stop": ["s"] * 65}
    with pytest.raises(V.MessageError, match="stop"):
        P.worker_codec().decode(
            msgspec.msgpack.encode(
                {"v": 2, "t": "generate", "rid": "r", "prompt_ids": [1], "params": params}
            )
        )


def test_a_lost_output_fails_the_request_instead_of_truncating_it(tiny_llama_dir: Path) -> None:
    """A stand-in worker (a fault injector speaking the real protocol over CURVE) skips an
    output's sequence number: the router fails the request with 502, never a short 200."""
    from hetero_pd.serving.router.errors import RouterError
    from hetero_pd.serving.router.router import Router, RouterConfig

    secret = secrets.generate().encode()
    server = ControlServer("127.0.0.1", 0, WorkerKeys.from_secret(secret, "decode-0"))
    info = V.WorkerInfo(address=f"tcp://127.0.0.1:{server.port}", max_model_len=64)

    async def fake_worker(stop: asyncio.Event) -> None:
        while not stop.is_set():
            if server.poll(0):
                for ident, msg in server.receive():
                    if isinstance(msg, P.Hello):
                        server.send(ident, P.Ready(worker="decode-0", role="both", info=info))
                    elif isinstance(msg, P.Generate):
                        for seq in (0, 2):  # output 1 never comes
                            server.send(
                                ident, P.Output(rid=msg.rid, seq=seq, text="a", token_ids=[1])
                            )
            await asyncio.sleep(0.01)

    async def scenario() -> str:
        router = Router(RouterConfig(), RouterKeys.from_secret(secret))
        stop = asyncio.Event()
        task = asyncio.create_task(fake_worker(stop))
        try:
            await router.add_worker("decode-0", info.address, timeout_s=10)
            with pytest.raises(RouterError) as e:
                async for _ in router.generate("r1", [1, 2], SamplingParams(max_tokens=8)):
                    pass
            return f"{e.value.status} {e.value.code}"
        finally:
            stop.set()
            await task
            await router.close()

    try:
        assert asyncio.run(scenario()) == "502 lost_output"
    finally:
        server.close()


def test_the_environment_carries_the_secret_to_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(secrets.ENV, raising=False)
    with pytest.raises(secrets.SecretError, match=secrets.ENV):
        secrets.from_env()
    monkeypatch.setenv(secrets.ENV, "short")
    with pytest.raises(secrets.SecretError, match="at least"):
        secrets.from_env()
    monkeypatch.setenv(secrets.ENV, "s" * 32)
    assert secrets.from_env() == b"s" * 32
    assert secrets.derive(b"s" * 32, "control") != secrets.derive(b"s" * 32, "transfer")
    assert os.environ[secrets.ENV] == "s" * 32


def test_a_worker_credential_round_trips_and_holds_no_router_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    secret = secrets.generate().encode()
    credential = secrets.WorkerCredential.for_worker(secret, "decode-0")
    monkeypatch.setenv(secrets.WORKER_ENV, credential.text())
    assert secrets.worker_credential_from_env("decode-0") == credential
    router, worker = RouterKeys.from_secret(secret), WorkerKeys.of(credential)
    assert worker.router_public == router.client_public != worker.server_public
    assert worker.server_public == router.worker_public("decode-0")
    assert router.client_secret not in credential.text().encode() + credential.material
    assert secret.decode() not in credential.text()
    for bad in ("", "hpdw2.x.y", credential.text().replace("hpdw2", "hpdw3")):
        monkeypatch.setenv(secrets.WORKER_ENV, bad)
        with pytest.raises(secrets.SecretError, match=secrets.WORKER_ENV):
            secrets.worker_credential_from_env("decode-0")
    env = secrets.worker_environment(
        {secrets.ENV: secret.decode(), "PATH": "/bin"}, secret, ["decode-0"]
    )
    assert env == {"PATH": "/bin", secrets.WORKER_ENV: credential.text()}

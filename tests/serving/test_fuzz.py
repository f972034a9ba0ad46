"""Bounded, seeded fuzzing of the two doors a peer reaches: a worker's control endpoint (as
an authenticated member of the deployment, so frames get past CurveZMQ to the decoder) and
the router's edge-session WebSocket. Thousands of frames mutated from valid ones: no worker
or router dies, no 5xx, memory stays bounded, and every block comes back."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import msgspec
import pytest
import zmq

from hetero_pd import SamplingParams
from hetero_pd.deploy.testing import Stack, deployment, running_stack
from hetero_pd.serving.api import edge_protocol as E
from hetero_pd.serving.control import protocol as P
from hetero_pd.serving.control import values as V
from hetero_pd.serving.control.auth import secure_client
from transfer import RemoteBlocks

FRAMES = 3000
SESSIONS = 300


@pytest.fixture(scope="module")
def stack(tiny_llama_dir: Path) -> Iterator[Stack]:
    with running_stack(deployment(tiny_llama_dir)) as s:
        yield s


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def mutate(rng: random.Random, frame: bytes) -> bytes:
    data = bytearray(frame)
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(6)
        i = rng.randrange(len(data)) if data else 0
        if kind == 0 and data:  # flip a bit
            data[i] ^= 1 << rng.randrange(8)
        elif kind == 1:  # a random byte in
            data.insert(i, rng.randrange(256))
        elif kind == 2 and data:  # cut
            del data[i:]
        elif kind == 3:  # a msgpack header claiming a huge array or map
            data[i:i] = rng.choice([b"\xdd\xff\xff\xff\xff", b"\xdf\x7f\xff\xff\xff", b"\xc6\xff"])
        elif kind == 4 and data:  # a slice repeated
            j = rng.randrange(i, len(data) + 1)
            data[i:i] = data[i:j] * rng.randint(1, 3)
        else:  # a big or negative integer
            data[i:i] = rng.choice([b"\xcf" + b"\xff" * 8, b"\xd3" + b"\x80" + b"\x00" * 7])
    return bytes(data)


def control_seeds(rng: random.Random) -> list[bytes]:
    codec = P.worker_codec()
    params = P.WireParams.of(SamplingParams(max_tokens=2, temperature=0))
    rid = f"fz{rng.randrange(10**9)}"
    frame = V.HiddenFrame(
        version=1,
        dtype="float16",
        shape=[1, 64],
        scale=b"",
        data=b"\0" * 128,
        outliers=0,
        outlier_index=b"",
        outlier_value=b"",
    )
    blocks = RemoteBlocks(rid, 3, (1, 2), "kv")
    msgs = [
        P.Hello(),
        P.Check(),
        P.Generate(rid=rid, prompt_ids=[1, 2, 3, 4], params=params),
        P.Reserve(rid=rid, prompt_ids=[1] * 40, params=params, writer="prefill-0"),
        P.Prefill(
            rid=rid,
            prompt_ids=[1, 2],
            params=params,
            dest_worker_id="decode-0",
            dest_address="tcp://127.0.0.1:9",
            dest_blocks=blocks,
        ),
        P.Hidden(rid=rid, frame=frame),
        P.KvReady(rid=rid, first_token=3),
        P.KvFailed(rid=rid),
        P.Abort(rid=rid),
    ]
    return [codec.encode(m) for m in msgs]


def test_fuzz_the_worker_control_endpoint(stack: Stack) -> None:
    assert stack.router is not None and stack.launcher is not None
    pids = dict(stack.launcher.pids())
    before = {worker_id: rss_bytes(pid) for worker_id, pid in pids.items()}
    rng = random.Random(20261201)
    ctx = zmq.Context()
    try:
        for client in stack.router.workers.values():
            sock = ctx.socket(zmq.DEALER)
            secure_client(sock, stack.router.keys, client.worker_id)
            sock.connect(client.address)
            for _ in range(FRAMES // len(pids)):
                frame = mutate(rng, rng.choice(control_seeds(rng)))
                sock.send(frame)
                while sock.poll(0):
                    sock.recv()  # answers to frames that stayed valid
            sock.close(linger=1000)  # gone: the worker ends what this peer started
    finally:
        ctx.term()
    assert stack.launcher.pids() == pids
    stack.wait_idle(timeout_s=60)
    for worker_id, pid in pids.items():
        assert rss_bytes(pid) - before[worker_id] < 256 * 2**20, worker_id
    assert all(w.alive for w in stack.router.workers.values())


async def _edge_sessions(url: str, frames: list[bytes]) -> list[tuple[int, str]]:
    """Each frame opens a session; what came back: (HTTP status of the upgrade, the
    session's last message tag or close)."""
    out = []
    async with aiohttp.ClientSession() as session:
        for frame in frames:
            try:
                async with session.ws_connect(url + E.PATH) as ws:
                    await ws.send_bytes(frame)
                    reply = await ws.receive(timeout=30)
                    tag = "close"
                    if reply.type == aiohttp.WSMsgType.BINARY:
                        tag = msgspec.msgpack.decode(reply.data).get("t", "?")
                    out.append((101, tag))
            except aiohttp.WSServerHandshakeError as e:
                out.append((e.status, "refused"))
    return out


def test_fuzz_the_edge_session(stack: Stack) -> None:
    rng = random.Random(7)
    frame = {
        "version": 1,
        "dtype": "float16",
        "shape": [2, 64],
        "scale": b"",
        "data": b"\0" * 256,
        "outliers": 0,
        "outlier_index": b"",
        "outlier_value": b"",
    }
    seeds = [
        E.pack(
            "start",
            model=stack.dep.model,
            split_layer=1,
            fingerprint="f",
            params={"max_tokens": 2},
            prompt=frame,
            mode="prompt_only",
            prompt_kv={**frame, "shape": [4, 32], "data": b"\0" * 256},
        ),
        E.pack(
            "start", model=stack.dep.model, split_layer=1, fingerprint="f", params={}, prompt=frame
        ),
        E.pack("hidden", frame=frame),
    ]
    frames = [mutate(rng, rng.choice(seeds)) for _ in range(SESSIONS)]
    started = time.monotonic()
    results = asyncio.run(_edge_sessions(stack.url, frames))
    assert len(results) == SESSIONS and time.monotonic() - started < 300
    assert all(status == 101 for status, _ in results), results
    assert {tag for _, tag in results} <= {"error", "token", "close"}
    health = stack.metric("hetero_pd_worker_up", worker="decode-0", role="decode")
    assert health == 1.0
    stack.wait_idle(timeout_s=60)

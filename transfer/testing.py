"""A transfer engine in a child process, driven over a pipe: for tests and the benchmark.

The child starts from its :class:`~transfer.config.TransferConfig` and :class:`RegionSpec`
(process arguments); after that the control channel carries msgpack bytes, never pickles:
typed commands (tagged msgspec Structs, one per operation, decoded as the ``Command`` union
and dispatched by ``match``) and typed answers (:class:`Outcome`, :class:`PeerCounts`).
The child owns one engine and one region filled with deterministic data; :class:`PeerProcess`
is the parent's handle to it and always kills the child on exit. Children fork from a
multiprocessing fork server that imported this module (torch, zmq) once, not from the
parent: each starts fresh (no engine, no socket, the parent's environment of the moment)
without paying torch's import again, as a spawned child would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import multiprocessing as mp
import os
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import torch
import zmq

from transfer import auth, layout, wire
from transfer.config import TransferConfig
from transfer.engine import TransferEngine
from transfer.handle import RemoteBlocks, TransferHandle
from transfer.messages import About, Auth, Challenge, Hello, Message
from transfer.metrics import TransferMetrics
from transfer.region import KVRegion, parse_dtype


@dataclass(frozen=True, slots=True)
class RegionSpec:
    """The child's region: ``layers`` x ``blocks`` blocks of ``block_shape``, in /dev/shm
    when ``shared``, filled by :func:`fill` with ``seed``."""

    layers: int = 4
    blocks: int = 64
    block_shape: tuple[int, ...] = (16, 2, 8)
    dtype: str = "float32"
    shared: bool = True
    seed: int = 1


@dataclass(frozen=True, slots=True)
class PeerCounts:
    """What :meth:`PeerProcess.counts` reports (after the child checked its integrity)."""

    held: int
    reserved: int
    metrics: TransferMetrics


@dataclass(frozen=True, slots=True)
class Outcome:
    """A child's handle once waited for: its state (``TransferState.value``), error code
    name, why a push's hold ended, and attempts so far."""

    state: str
    code: str | None
    released: str | None
    attempts: int


def fill(region: KVRegion, seed: int) -> None:
    """Deterministic contents, different per tensor and block."""
    gen = torch.Generator().manual_seed(seed)
    for t in region.tensors:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))


def blocks_digest(region: KVRegion, ids: list[int], layers: tuple[int, int] | None = None) -> str:
    """SHA-256 over blocks ``ids`` of every tensor in ``layers`` (for equality checks)."""
    h = hashlib.sha256()
    index = torch.tensor(ids, dtype=torch.long)
    for ti in region.tensor_range(layers):
        h.update(layout.as_bytes(region.tensors[ti].index_select(0, index).contiguous()))
    return h.hexdigest()


def make_config(spec: Mapping[str, object]) -> TransferConfig:
    """TransferConfig from plain values (faults as a list of rule dicts, retry as a dict);
    an unknown key is a TypeError naming it, a bad value TransferConfig's own error."""
    unknown = sorted(set(spec) - {f.name for f in dataclasses.fields(TransferConfig)})
    if unknown:
        raise TypeError(f"make_config: unknown TransferConfig field(s) {unknown}")
    values = dict(spec)
    if isinstance(values.get("secret"), str):
        values["secret"] = str(values["secret"]).encode()
    if values.get("faults"):
        values["faults"] = {"rules": values["faults"]}
    else:
        values.pop("faults", None)
    return msgspec.convert(values, TransferConfig, strict=False)


def hostile_link(address: str, claimed: str, secret: bytes, timeout_s: float = 5.0) -> Message:
    """What a hostile process gets for a handshake with the engine at ``address``: a HELLO
    as engine ``claimed``, then an AUTH proven under ``secret`` (even when the CHALLENGE's
    own proof showed another secret); the listener's last answer (ERROR, or WELCOME)."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    try:
        nonce = auth.new_nonce()
        sock.send(wire.encode(Hello(engine_id=claimed, role="prefill", nonce=nonce)))
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no answer to HELLO from {address}")
        answer = wire.decode(sock.recv(), 1).msg
        if not isinstance(answer, Challenge):
            return answer
        proof = auth.client_proof(secret, nonce, answer.nonce, claimed, answer.engine_id)
        about = About(host="127.0.0.1", pid=1, data_address="", regions=[], fingerprint="")
        sock.send(wire.encode(Auth(proof=proof, about=about)))
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no answer to AUTH from {address}")
        return wire.decode(sock.recv(), 1).msg
    finally:
        sock.close()


def _outcome(h: TransferHandle) -> Outcome:
    code = h.error.code.name if h.error else None
    return Outcome(h.state.value, code, h.released, h.attempts)


def _context() -> mp.context.ForkServerContext | mp.context.SpawnContext:
    """Fork server where there is one (POSIX), preloaded with this module; else spawn."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


def _serve(
    conn: Connection,
    engine_id: str,
    config: TransferConfig,
    region: RegionSpec,
    environ: dict[str, str],
) -> None:
    os.environ.clear()  # the parent's of now, not the fork server's of its start
    os.environ.update(environ)
    torch.set_num_threads(1)
    engine = TransferEngine(engine_id, "both", config)
    reg = KVRegion.allocate(
        "kv",
        region.layers,
        region.blocks,
        region.block_shape,
        parse_dtype(region.dtype),
        shared=region.shared,
    )
    fill(reg, region.seed)
    engine.register_region(reg)
    handles: dict[str, TransferHandle] = {}
    conn.send_bytes(
        msgspec.msgpack.encode({"address": engine.address, "data_address": engine.data_address})
    )
    try:
        while True:
            cmd = msgspec.msgpack.decode(conn.recv_bytes(), type=Command)
            if isinstance(cmd, Stop):
                break
            try:
                out = _command(engine, reg, handles, cmd)
            except Exception as exc:  # reported to the parent, which raises it
                conn.send_bytes(msgspec.msgpack.encode({"ok": False, "error": repr(exc)}))
                continue
            engine.progress()
            conn.send_bytes(msgspec.msgpack.encode({"ok": True, "out": out}))
    except EOFError:
        pass
    finally:
        engine.close()


class _Command(msgspec.Struct, tag_field="op", forbid_unknown_fields=True):
    """One request from the parent to the child engine (`PeerProcess.call(op, **fields)`)."""


class Link(_Command, tag="link"):
    peer: str
    address: str


class Trust(_Command, tag="trust"):
    peer: str
    secret: bytes


class Reserve(_Command, tag="reserve"):
    rid: str
    ids: list[int]
    timeout: float | None = None
    writer: str | None = None


class Release(_Command, tag="release"):
    rid: str


class Offer(_Command, tag="offer"):
    rid: str
    ids: list[int]
    reader: str
    layers: tuple[int, int] | None = None
    lease_s: float | None = None


class Wait(_Command, tag="wait"):
    rid: str
    timeout: float


class Push(_Command, tag="push"):
    peer: str
    src: list[int]
    dst: RemoteBlocks
    transport: str | None = None


class Digest(_Command, tag="digest"):
    ids: list[int]
    layers: tuple[int, int] | None = None


class Zero(_Command, tag="zero"):
    pass


class Counts(_Command, tag="counts"):
    pass


class Stop(_Command, tag="stop"):
    pass


Command = Link | Trust | Reserve | Offer | Release | Wait | Push | Digest | Zero | Counts | Stop
_COMMANDS: dict[str, type[_Command]] = {
    c.__struct_config__.tag: c  # type: ignore[misc]
    for c in (Link, Trust, Reserve, Offer, Release, Wait, Push, Digest, Zero, Counts, Stop)
}


def _command(
    engine: TransferEngine, reg: KVRegion, handles: dict[str, TransferHandle], cmd: Command
) -> object:
    match cmd:
        case Link(peer=peer, address=address):
            engine.link(peer, address)
        case Trust(peer=peer, secret=secret):
            engine.trust(peer, secret)
        case Reserve():
            h = engine.reserve(cmd.rid, cmd.ids, timeout_s=cmd.timeout, writer=cmd.writer)
            handles[cmd.rid] = h
            assert h.blocks is not None
            return h.blocks.to_wire()
        case Offer():
            h = engine.offer(
                cmd.rid, cmd.ids, reader=cmd.reader, layers=cmd.layers, lease_s=cmd.lease_s
            )
            handles[f"offer/{cmd.rid}"] = h
            assert h.blocks is not None
            return h.blocks.to_wire()
        case Wait():
            h = handles[cmd.rid]
            h.wait(cmd.timeout)
            return _outcome(h)
        case Release(rid=rid):
            engine.release(rid)
        case Push():
            h = engine.push_blocks(cmd.peer, cmd.src, cmd.dst, transport=cmd.transport)
            handles[h.transfer_id] = h
            return h.transfer_id
        case Digest():
            return blocks_digest(reg, cmd.ids, cmd.layers)
        case Zero():
            for t in reg.tensors:
                t.zero_()
        case Counts():
            engine.check_integrity()
            return PeerCounts(
                held=sum(engine.held_blocks().values()),
                reserved=sum(engine.reserved_blocks().values()),
                metrics=engine.metrics(),
            )
    return None


class PeerProcess:
    """Parent-side handle of a child engine process (see the module docstring; killed on
    close)."""

    def __init__(
        self,
        engine_id: str,
        config: TransferConfig | None = None,
        region: RegionSpec | None = None,
        start_timeout: float = 60.0,
    ) -> None:
        ctx = _context()
        self.engine_id = engine_id
        self._conn, child = ctx.Pipe()
        args = (child, engine_id, config or TransferConfig(), region or RegionSpec())
        self.process = ctx.Process(target=_serve, args=(*args, dict(os.environ)), daemon=True)
        self.process.start()
        child.close()
        hello = self._recv(start_timeout)
        self.address: str = hello["address"]
        #: ``host:port`` of the child's data channel ("" when it has none).
        self.data_address: str = hello["data_address"]

    def _recv(self, timeout: float) -> Any:
        if not self._conn.poll(timeout):
            raise TimeoutError(f"peer {self.engine_id} did not answer within {timeout}s")
        return msgspec.msgpack.decode(self._conn.recv_bytes())

    def call(self, op: str, call_timeout: float = 30.0, **kwargs: Any) -> Any:
        """Run one command in the child and return its result (its errors re-raised here)."""
        command = msgspec.convert(kwargs, _COMMANDS[op])  # a bad field fails here
        self._conn.send_bytes(msgspec.msgpack.encode(command))
        reply = self._recv(call_timeout)
        if not reply["ok"]:
            raise RuntimeError(f"peer {self.engine_id}: {op} failed: {reply['error']}")
        return reply["out"]

    def wait(self, rid: str, timeout: float) -> Outcome:
        """Wait up to ``timeout`` for the child's reservation ``rid``; its outcome so far."""
        return msgspec.convert(self.call("wait", rid=rid, timeout=timeout), Outcome)

    def counts(self) -> PeerCounts:
        """The child's held and reserved blocks and its metrics (it checks its integrity)."""
        return msgspec.convert(self.call("counts"), PeerCounts)

    def kill(self) -> None:
        """SIGKILL the child (simulates a crashed worker)."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)

    def close(self) -> None:
        """Stop the child gracefully, killing it if it does not exit quickly."""
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self._conn.send_bytes(msgspec.msgpack.encode(Stop()))
            self.process.join(5)
        self.kill()
        self._conn.close()

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

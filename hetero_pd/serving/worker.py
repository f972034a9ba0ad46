"""A worker process: one engine on one device, a ZMQ control endpoint, the transfer engine
wired to its KV cache.

    router --(generate | reserve | prefill | kv_ready | kv_failed | abort | check)--> worker
    worker --(ready | heartbeat | output | reserved | prefill_done | error | integrity)--> router

The loop is single-threaded: poll the control socket, step the engine, progress transfers,
send heartbeats. The transfer engine's own I/O thread moves the KV bytes.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import zmq

from hetero_pd import hidden_codec
from hetero_pd.config import EngineConfig
from hetero_pd.engine.block_pool import NoFreeBlocksError
from hetero_pd.engine.llm_engine import LLMEngine
from hetero_pd.engine.scheduler import Role, SchedulerOutput
from hetero_pd.models.fingerprint import split_fingerprint
from hetero_pd.serving import messages as M
from hetero_pd.serving.prefill_push import PushTracker
from transfer import EngineConfig as TransferConfig
from transfer import (
    FaultPlan,
    FaultRule,
    KVRegion,
    RemoteBlocks,
    TransferEngine,
    TransferError,
    TransferHandle,
)

log = logging.getLogger("hetero_pd.worker")
READY_LINE = "HETERO_PD_WORKER_READY"
TRANSPORTS = ("local", "cuda_ipc", "shm", "tcp")


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    worker_id: str
    role: str  # prefill | decode | both
    engine: dict[str, Any]  # EngineConfig fields (model, device, dtype, ...)
    host: str = "127.0.0.1"
    heartbeat_s: float = 0.5
    layerwise: bool = False  # push each layer's KV as soon as it is computed
    transfer_secret: str = ""
    transfer_timeout_s: float = 30.0
    transfer_grant_s: float = 10.0
    transfer_transports: tuple[str, ...] = TRANSPORTS
    checksum: bool = True
    remote_kv_timeout_s: float = 60.0
    cpus: tuple[int, ...] = field(default_factory=tuple)
    #: Tests and fault drills only: FaultRule fields for this worker's outgoing transfer frames.
    transfer_faults: tuple[dict[str, Any], ...] = ()
    #: Fixed ports (Kubernetes: derived from kubernetes.base_port); 0 = any free port.
    port: int = 0
    transfer_port: int = 0
    #: The name peers reach this worker by when it binds 0.0.0.0 (its pod's DNS name).
    advertise_host: str = ""
    #: Touched on every heartbeat of the main loop (Kubernetes exec probes read its age).
    alive_file: str = ""
    #: The launcher's pid: a worker whose launcher is gone stops instead of living on.
    parent_pid: int = 0

    @classmethod
    def from_json(cls, text: str) -> WorkerConfig:
        raw = json.loads(text)
        raw["transfer_transports"] = tuple(raw.get("transfer_transports", TRANSPORTS))
        raw["cpus"] = tuple(raw.get("cpus", ()))
        raw["transfer_faults"] = tuple(raw.get("transfer_faults", ()))
        return cls(**raw)

    def to_json(self) -> str:
        return json.dumps(asdict(self))


class Worker:
    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        self.id = cfg.worker_id
        faults = None
        if cfg.transfer_faults:
            faults = FaultPlan(tuple(FaultRule(**rule) for rule in cfg.transfer_faults))
        tcfg = TransferConfig(
            host=cfg.host,
            port=cfg.transfer_port,
            secret=cfg.transfer_secret.encode(),
            transfer_timeout_s=cfg.transfer_timeout_s,
            grant_s=cfg.transfer_grant_s,
            transports=cfg.transfer_transports,
            checksum_stream=cfg.checksum,
            faults=faults,
        )
        role = {"prefill": "prefill", "decode": "decode"}.get(cfg.role, "mixed")
        self.transfer = TransferEngine(cfg.worker_id, role, tcfg)
        self.region: KVRegion | None = None
        engine_cfg = EngineConfig.from_kwargs(**{**cfg.engine, "role": cfg.role})
        self.engine = LLMEngine(engine_cfg, kv_allocator=self._allocate_kv)
        assert self.region is not None
        self.transfer.register_region(self.region)
        self.ctx: Any = zmq.Context()
        self.sock: Any = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if cfg.port:
            self.sock.bind(f"tcp://{cfg.host}:{cfg.port}")
            self.port = cfg.port
        else:
            self.port = self.sock.bind_to_random_port(f"tcp://{cfg.host}")
        self.address: str = self._advertised(f"tcp://{cfg.host}:{self.port}")
        self.switch_to: str | None = None  # a role switch waits until the worker is idle
        self.routers: set[bytes] = set()
        self.owner: dict[str, bytes] = {}  # request id -> router identity
        self.recv: dict[str, TransferHandle] = {}  # decode: reservations awaiting KV
        # decode: released reservations whose blocks a direct writer may still touch until
        # `until`; the engine frees or reuses them (the action) only after that.
        self.fenced: dict[str, tuple[float, Callable[[str], None]]] = {}
        self.pushes: PushTracker = PushTracker(self.transfer, self.engine, self._on_push_result)
        #: > 0: a split (edge) worker running layers [start_layer, L) on hidden states.
        self.start_layer: int = self.engine.config.start_layer
        self.fingerprint: str = (
            split_fingerprint(self.engine.model_path, self.start_layer) if self.start_layer else ""
        )
        self.linked: set[str] = set()
        self.draining: bool = False
        #: Reserved prompts whose KV never arrived whole, so this worker computed them.
        self.kv_fallbacks: int = 0
        self.stopped: bool = False
        self._last_heartbeat: float = 0.0

    def _allocate_kv(
        self,
        num_layers: int,
        num_blocks: int,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
    ) -> list[torch.Tensor]:
        # On the CPU the cache lives in shared memory so a peer on this host writes into it.
        shared = device.type == "cpu" and "shm" in self.cfg.transfer_transports
        self.region = KVRegion.allocate(
            "kv", num_layers, num_blocks, block_shape, dtype, device=device, shared=shared
        )
        return self.region.tensors

    def info(self) -> dict[str, Any]:
        e = self.engine
        return {
            "address": self.address,
            "transfer_address": self._advertised(self.transfer.address),
            "model": str(e.config.model),
            "device": str(e.device),
            "max_model_len": e.max_model_len,
            "block_size": e.config.block_size,
            "num_blocks": e.kv.pool.num_blocks,
            "pid": os.getpid(),
            "start_layer": self.start_layer,
            "hidden_size": e.model_config.hidden_size,
            "fingerprint": self.fingerprint,
        }

    # -- main loop -----------------------------------------------------------------------
    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self.stopped:
            events = dict(poller.poll(self._poll_ms()))
            if self.sock in events:
                self._drain_socket()
            if self.engine.has_unfinished_requests():
                for out in self.engine.step(self._layer_hook):
                    self._on_output(out)
                for failure in self.engine.pop_failures():
                    self.pushes.cancel(failure.request_id)
                    self._error(failure.request_id, "BAD_REQUEST", failure.message, False)
                    self.owner.pop(failure.request_id, None)
            self.transfer.progress()
            self._expire_reservations()
            self._unfence()
            now = time.monotonic()
            if now - self._last_heartbeat >= self.cfg.heartbeat_s:
                self._heartbeat(now)
            if self.draining and not self._busy():
                break
            if self.switch_to is not None and not self._busy() and not self.recv:
                self._switch_role(self.switch_to)
        self._broadcast(M.encode("bye", worker=self.id))

    def _advertised(self, address: str) -> str:
        if not self.cfg.advertise_host:
            return address
        return f"tcp://{self.cfg.advertise_host}:{address.rsplit(':', 1)[1]}"

    def _switch_role(self, role: str) -> None:
        """Drained (nothing in flight): now serve as `role`, and say so with a new ready."""
        engine = self.engine
        new: Role = "prefill" if role == "prefill" else "decode"
        engine.config = replace(engine.config, role=new)
        engine.scheduler.config = replace(engine.scheduler.config, role=new)
        self.cfg = replace(self.cfg, role=role)
        self.switch_to = None
        log.info("%s now serves as %s", self.id, role)
        self._broadcast(M.encode("ready", worker=self.id, role=role, info=self.info()))

    def _busy(self) -> bool:
        return self.engine.has_unfinished_requests() or self.pushes.active or bool(self.fenced)

    def _poll_ms(self) -> int:
        s = self.engine.scheduler
        if s.waiting or s.running:
            return 0  # the engine has a step to run
        # Only waiting on transfers (remote KV, pushes, fences): check often, without spinning
        # on a core the other worker may need.
        return 1 if self._busy() else 20

    def close(self) -> None:
        self.transfer.close()
        self.sock.close()
        self.ctx.term()

    def _drain_socket(self) -> None:
        while True:
            try:
                ident, frame = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except ValueError:
                continue  # wrong number of frames: not one of ours
            self.routers.add(ident)
            try:
                msg = M.decode(frame)
                self._handle(ident, msg)
            except M.MessageError as e:
                log.warning("%s: rejected control frame: %s", self.id, e)
            except (ValueError, TypeError, KeyError, TransferError) as e:
                rid = msg.get("rid", "") if isinstance(msg, dict) else ""
                if isinstance(e, TransferError):
                    code, recoverable = e.code.name, e.code.recoverable
                else:
                    code, recoverable = "BAD_REQUEST", False
                error = M.encode(
                    "error", rid=rid, code=code, message=str(e), recoverable=recoverable
                )
                self._send(ident, error)
                self.owner.pop(rid, None)

    def _send(self, ident: bytes, frame: bytes) -> None:
        try:
            self.sock.send_multipart([ident, frame], zmq.NOBLOCK)
        except zmq.Again:
            log.warning("%s: router %r not reading; message dropped", self.id, ident)

    def _broadcast(self, frame: bytes) -> None:
        for ident in list(self.routers):
            self._send(ident, frame)

    def _reply(self, rid: str, frame: bytes) -> None:
        ident = self.owner.get(rid)
        if ident is not None:
            self._send(ident, frame)

    def _error(self, rid: str, code: str, message: str, recoverable: bool) -> None:
        self._reply(
            rid, M.encode("error", rid=rid, code=code, message=message, recoverable=recoverable)
        )

    # -- messages ------------------------------------------------------------------------
    def _handle(self, ident: bytes, msg: dict[str, Any]) -> None:
        kind = msg["t"]
        if kind == "hello":
            self._send(
                ident, M.encode("ready", worker=self.id, role=self.cfg.role, info=self.info())
            )
            return
        if kind == "check":
            self._send(ident, self._integrity())
            return
        if kind == "switch_role":
            if msg["role"] not in ("prefill", "decode") or self.cfg.role == "both":
                raise ValueError(f"{self.id} ({self.cfg.role}) cannot switch to {msg['role']!r}")
            self.switch_to = msg["role"]
            return
        if kind == "shutdown":
            self.draining = True
            if not msg["drain"]:
                self.stopped = True
            return
        rid = msg["rid"]
        if kind in ("generate", "reserve", "prefill"):
            if self.draining or self.switch_to is not None:
                self.owner[rid] = ident
                self._error(rid, "DRAINING", f"worker {self.id} is draining", True)
                self.owner.pop(rid, None)
                return
            self.owner[rid] = ident
        handler = getattr(self, f"_on_{kind}", None)
        if handler is None:
            raise ValueError(f"message type {kind!r} is not for a worker")
        handler(msg)

    def _prompt_hidden(
        self, msg: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """An edge prompt from its frames: (hidden states [num_tokens, hidden], and for a
        whole-model worker the device's early-layer KV [k, 2, num_tokens, kv_heads,
        head_dim]); None for a prompt of token ids."""
        frame = msg.get("hidden")
        if frame is None:
            if self.start_layer:
                raise ValueError(
                    f"worker {self.id} runs layers [{self.start_layer}, L): it takes hidden "
                    "states from an edge session, not prompt token ids"
                )
            return None
        cfg = self.engine.model_config
        hidden = hidden_codec.decode(frame, cfg.hidden_size)
        kv_frame, k = msg.get("early_kv"), msg.get("early_layers", 0)
        if self.start_layer:
            if kv_frame is not None:
                raise ValueError(f"worker {self.id} runs layers [{self.start_layer}, L): no KV")
            return hidden, None
        if kv_frame is None or not 1 <= k < cfg.num_layers:
            raise ValueError(
                f"worker {self.id} runs the whole model: an edge prompt needs the KV of the "
                f"device's layers (early_kv, early_layers in [1, {cfg.num_layers}))"
            )
        flat = hidden_codec.decode(kv_frame, cfg.num_kv_heads * cfg.head_dim)
        n = hidden.shape[0]
        if flat.shape[0] != 2 * k * n:
            raise ValueError(f"early_kv holds {flat.shape[0]} rows, not 2 x {k} x {n}")
        return hidden, flat.view(k, 2, n, cfg.num_kv_heads, cfg.head_dim)

    def _add_edge_prompt(
        self,
        edge: tuple[torch.Tensor, torch.Tensor | None],
        msg: dict[str, Any],
        params: Any,
        remote_kv: bool = False,
    ) -> list[int] | None:
        hidden, early = edge
        rid, priority = msg["rid"], msg["priority"]
        if early is None:
            return self.engine.add_split_request(hidden, params, rid, priority, remote_kv)
        return self.engine.add_edge_prompt_request(hidden, early, params, rid, priority, remote_kv)

    def _on_generate(self, msg: dict[str, Any]) -> None:
        params = M.params_from_wire(msg["params"])
        edge = self._prompt_hidden(msg)
        if edge is not None:
            self._add_edge_prompt(edge, msg, params)
            return
        self.engine.add_request(msg["prompt_ids"], params, msg["rid"], msg["priority"])

    def _on_hidden(self, msg: dict[str, Any]) -> None:
        """An edge device's hidden state for a split request's newest token."""
        rid = msg["rid"]
        if rid not in self.engine.scheduler.requests:
            return  # aborted or finished meanwhile
        row = hidden_codec.decode(msg["frame"], self.engine.model_config.hidden_size)
        if row.shape[0] != 1:
            raise ValueError(f"request {rid}: a hidden message carries one token, not {len(row)}")
        self.engine.supply_hidden(rid, row)

    def _on_reserve(self, msg: dict[str, Any]) -> None:
        rid = msg["rid"]
        params = M.params_from_wire(msg["params"])
        if rid in self.fenced:  # a retry while the previous attempt's blocks are fenced
            until = self.fenced[rid][0]
            message = (
                f"request {rid}: its previous blocks are fenced for {until - time.monotonic():.2f}s"
            )
            self._error(rid, "KV_FENCED", message, True)
            self.owner.pop(rid, None)
            return
        edge = self._prompt_hidden(msg)
        try:
            if edge is not None:
                reserved = self._add_edge_prompt(edge, msg, params, remote_kv=True)
                assert reserved is not None
                block_ids = reserved
            else:
                block_ids = self.engine.add_remote_request(
                    msg["prompt_ids"], params, rid, msg["priority"]
                )
        except NoFreeBlocksError as e:
            self._error(rid, "NO_FREE_BLOCKS", str(e), True)
            self.owner.pop(rid, None)
            return
        try:
            # A split engine has no KV below its start layer: only [start, L) will arrive.
            layers = (
                (self.start_layer, self.engine.model_config.num_layers)
                if self.start_layer
                else None
            )
            handle = self.transfer.reserve(
                rid, block_ids, timeout_s=self.cfg.remote_kv_timeout_s, layers=layers
            )
        except TransferError as e:
            self.engine.abort_request(rid)
            self._error(rid, e.code.name, str(e), e.code.recoverable)
            self.owner.pop(rid, None)
            return
        self.recv[rid] = handle
        blocks = handle.blocks
        assert blocks is not None
        self._reply(rid, M.encode("reserved", rid=rid, blocks=blocks.to_wire(), cached_tokens=0))

    def _on_prefill(self, msg: dict[str, Any]) -> None:
        rid = msg["rid"]
        params = M.params_from_wire(msg["params"])
        dest = RemoteBlocks.from_wire(msg["dest_blocks"])
        edge = self._prompt_hidden(msg)
        peer = msg["dest_worker"]
        if peer not in self.linked:
            try:
                self.transfer.link(peer, msg["dest_address"])
            except TransferError as e:
                self._error(rid, e.code.name, str(e), e.code.recoverable)
                self.owner.pop(rid, None)
                return
            self.linked.add(peer)
        if edge is not None:
            self._add_edge_prompt(edge, msg, params)
        else:
            self.engine.add_request(msg["prompt_ids"], params, rid, msg["priority"])
        self.pushes.expect(rid, peer, dest)

    def _on_kv_ready(self, msg: dict[str, Any]) -> None:
        rid = msg["rid"]
        handle = self.recv.pop(rid, None)
        if handle is None:
            return  # aborted meanwhile
        if handle.state.value != "done":
            # The sender saw an ACK we never gave for this epoch: never trust those blocks.
            log.warning(
                "%s: request %s: KV not complete at kv_ready; computing it here", self.id, rid
            )
            self.kv_fallbacks += 1
            self._reply(rid, M.encode("kv_fallback", rid=rid))
            self._release(rid, self.engine.remote_kv_failed)
            return
        self.transfer.release(rid)  # every write was committed: no grant is left open
        self._on_output(self.engine.remote_kv_ready(rid, msg["first_token"]))

    def _on_kv_failed(self, msg: dict[str, Any]) -> None:
        rid = msg["rid"]
        if self.recv.pop(rid, None) is not None:
            self._release(rid, self.engine.remote_kv_failed)

    def _on_abort(self, msg: dict[str, Any]) -> None:
        rid = msg["rid"]
        self.pushes.cancel(rid)
        if rid in self.fenced:
            self.fenced[rid] = (self.fenced[rid][0], self.engine.abort_request)
        elif self.recv.pop(rid, None) is not None:
            self._release(rid, self.engine.abort_request)
        else:
            self.engine.abort_request(rid)
        self.owner.pop(rid, None)

    def _release(self, rid: str, then: Callable[[str], None]) -> None:
        """Releases `rid`'s reservation, then runs `then(rid)` (which frees or reuses its
        blocks in the engine) once no direct (shared-memory) writer can still write there."""
        wait = self.transfer.release(rid)
        if wait > 0:
            self.fenced[rid] = (time.monotonic() + wait, then)
        else:
            then(rid)

    def _unfence(self) -> None:
        now = time.monotonic()
        for rid, (until, then) in list(self.fenced.items()):
            if until <= now:
                del self.fenced[rid]
                then(rid)

    # -- engine and transfer events ------------------------------------------------------
    def _on_output(self, out: Any) -> None:
        rid = out.request_id
        if self.pushes.is_pushing(rid):
            if out.finished:
                self.pushes.prefill_finished(rid, out.outputs[0].token_ids[0])
            return
        c = out.outputs[0]
        self._reply(
            rid,
            M.encode(
                "output",
                rid=rid,
                text=c.delta_text,
                token_ids=c.delta_token_ids,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                prompt_tokens=len(out.prompt_token_ids),
                completion_tokens=len(c.token_ids),
                cached_tokens=out.num_cached_tokens,
            ),
        )
        if out.finished:
            self.owner.pop(rid, None)

    def _on_push_result(
        self, rid: str, first_token: int, error: TransferError | None, stats: dict[str, Any]
    ) -> None:
        if error is None:
            self._reply(
                rid, M.encode("prefill_done", rid=rid, first_token=first_token, transfer=stats)
            )
        else:
            self._error(rid, error.code.name, str(error), error.code.recoverable)
        self.owner.pop(rid, None)

    def _expire_reservations(self) -> None:
        for rid, handle in list(self.recv.items()):
            if handle.state.terminal and handle.state.value != "done":
                # Timed out or cancelled before kv_ready: compute the prompt here.
                self.recv.pop(rid)
                self.kv_fallbacks += 1
                self._release(rid, self.engine.remote_kv_failed)

    def _layer_hook(self, out: SchedulerOutput) -> Callable[[int], None]:
        """Runs after every layer of a step: layer-wise KV pushes, and heartbeats, so that a
        long step never looks like a dead worker to the router."""
        push = self.pushes.layer_hook(out) if self.cfg.layerwise else None

        def on_layer_done(layer: int) -> None:
            if push is not None:
                push(layer)
            now = time.monotonic()
            if now - self._last_heartbeat >= self.cfg.heartbeat_s:
                self._heartbeat(now)

        return on_layer_done

    def _heartbeat(self, now: float) -> None:
        self._last_heartbeat = now
        s = self.engine.scheduler
        load = {
            "waiting": len(s.waiting),
            "running": len(s.running),
            "remote": len(s.remote),
            "held": len(s.held),
            "waiting_tokens": sum(r.num_tokens - r.num_computed_tokens for r in s.waiting),
            "kv_usage": round(self.engine.kv.usage, 4),
            "free_blocks": self.engine.kv.num_free_blocks,
            "draining": self.draining or self.switch_to is not None,
            "kv_fallbacks": self.kv_fallbacks,
            "transfer": self.transfer.metrics(),
        }
        self._broadcast(M.encode("heartbeat", worker=self.id, load=load))
        if self.cfg.alive_file:
            Path(self.cfg.alive_file).touch()
        if self.cfg.parent_pid and os.getppid() != self.cfg.parent_pid:
            log.error("%s: its launcher (pid %s) is gone; stopping", self.id, self.cfg.parent_pid)
            self.draining = self.stopped = True

    def _integrity(self) -> bytes:
        try:
            self.engine.check_integrity()
        except AssertionError as e:
            return M.encode("integrity", ok=False, used_blocks=-1, message=str(e))
        used = self.engine.kv.pool.counts()[2]
        msg = "busy" if self._busy() or self.recv else "idle"
        return M.encode("integrity", ok=True, used_blocks=used, message=msg)


def run(cfg: WorkerConfig) -> int:
    """Runs one worker in this process until SIGTERM/SIGINT (drain) or its launcher exits."""
    if cfg.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cfg.cpus)
    if cfg.alive_file:
        Path(cfg.alive_file).parent.mkdir(parents=True, exist_ok=True)
    worker = Worker(cfg)

    def on_term(signum: int, frame: Any) -> None:
        worker.draining = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    print(f"{READY_LINE} {json.dumps({'worker': worker.id, **worker.info()})}", flush=True)
    try:
        worker.serve_forever()
    finally:
        worker.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    """`hetero-pd worker --config-json '{...}'`: run one worker in the foreground."""
    import argparse

    p = argparse.ArgumentParser(prog="hetero-pd worker")
    p.add_argument("--config-json", required=True, help="WorkerConfig as JSON")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return run(WorkerConfig.from_json(args.config_json))


if __name__ == "__main__":
    sys.exit(main())

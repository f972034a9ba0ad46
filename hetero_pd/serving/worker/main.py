"""A worker process: one engine on one device, its control endpoint, the transfer engine
wired to its KV cache.

    router --(Hello | PeerKeys | Generate | Reserve | Prefill | Hidden | KvReady | KvFailed
              | Abort | Check | Shutdown | SwitchRole | OfferPrefix | Migrate*)--> worker
    worker --(Ready | Heartbeat | Output | Reserved | KvFallback | PrefillDone | Error
              | Integrity | Bye | PrefixOffered | Migrate*)--> router

The loop is single-threaded: serve the control socket (`ControlServer`: authenticated,
typed, nothing dropped silently), step the engine, progress transfers, tick the requests'
state machines (`RequestBook`), send heartbeats. The transfer engine's own I/O thread moves
the KV bytes. Configuration comes as JSON on stdin; the worker's credential (never the deployment
secret) comes from the environment (`HETERO_PD_WORKER_KEY`), never from the command line.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
import torch

from backends.cpu_share import HostBoard
from hetero_pd import secrets
from hetero_pd.engine.llm_engine import LLMEngine
from hetero_pd.engine.scheduler import Role, SchedulerOutput
from hetero_pd.models.fetch import resolve_model
from hetero_pd.models.fingerprint import model_fingerprint, split_fingerprint
from hetero_pd.serving.control import migration as M
from hetero_pd.serving.control import protocol as P
from hetero_pd.serving.control import values as V
from hetero_pd.serving.control.auth import WorkerKeys
from hetero_pd.serving.control.server import ControlServer
from hetero_pd.serving.worker.config import WorkerConfig, transfer_config
from hetero_pd.serving.worker.embeds import EmbedQueue
from hetero_pd.serving.worker.prefix_share import offer_prefix, shares_prefixes
from hetero_pd.serving.worker.reports import load_report
from hetero_pd.serving.worker.requests import RequestBook
from hetero_pd.serving.worker.step_faults import StepFaults
from transfer import KVRegion, TransferEngine

log = logging.getLogger("hetero_pd.worker")
READY_LINE = "HETERO_PD_WORKER_READY"
#: A heartbeat reports the prefix cache when it changed, and at least this often.
CACHE_REPORT_S = 2.0


def ready_address(line: str | bytes) -> str:
    """The control address in a worker's READY line (what `run` prints below)."""
    text = line.decode() if isinstance(line, bytes) else line
    return str(json.loads(text[len(READY_LINE) :])["info"]["address"])


class Worker:
    def __init__(self, cfg: WorkerConfig, credential: secrets.WorkerCredential) -> None:
        self.cfg = cfg
        self.worker_id = cfg.worker_id
        #: Weights + tokenizer: prefill and decode compare it when they link.
        self.model_fingerprint: str = model_fingerprint(resolve_model(cfg.engine.model))
        self.transfer: TransferEngine = TransferEngine(
            cfg.worker_id, cfg.role, transfer_config(cfg, self.model_fingerprint)
        )
        self.region: KVRegion | None = None
        self.engine: LLMEngine = LLMEngine(
            replace(cfg.engine, role=cfg.role),
            kv_allocator=self._allocate,
            disk_key=credential.key("kv-disk"),
        )
        assert self.region is not None
        self.transfer.register_region(self.region)
        if cfg.cpu_board:
            self._share_cpus(cfg.cpu_board, cfg.cpu_board_slot)
        self.control: ControlServer = ControlServer(cfg.host, cfg.port, WorkerKeys.of(credential))
        self.address: str = self._advertised(f"tcp://{cfg.host}:{self.control.port}")
        self.book: RequestBook = RequestBook(
            self.worker_id, self.engine, self.transfer, self.control.send, cfg.remote_kv_timeout_s
        )
        self.embeds: EmbedQueue = EmbedQueue(self.engine.config.max_num_batched_tokens)
        self.step_faults: StepFaults = StepFaults(cfg.step_faults)
        if cfg.step_faults:
            log.warning("%s: its engine steps are delayed by fault rules", self.worker_id)
        self.role: Role = cfg.role
        start = self.engine.config.start_layer
        #: > 0: a split (edge) worker running layers [start_layer, L) on hidden states.
        self.fingerprint: str = split_fingerprint(self.engine.model_path, start) if start else ""
        self.switch_to: Role | None = None  # a role switch waits until the worker is idle
        self.draining: bool = False
        self.stopped: bool = False
        #: Why this worker must be replaced (it exits non-zero once drained), or None.
        self.fault: str | None = None
        self._last_heartbeat: float = 0.0
        self._reported: tuple[int, float] = (-1, 0.0)  # prefix cache version, when sent

    def _allocate(
        self,
        num_layers: int,
        num_blocks: int,
        block_shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        tensors_per_layer: int,
    ) -> list[torch.Tensor]:
        # On the CPU the cache lives in shared memory so a peer on this host writes into it,
        # and a tensor-parallel worker's ranks map their heads of it (engine/tp/kv.py).
        split = self.cfg.engine.tensor_parallel_size > 1
        shared = device.type == "cpu" and ("shm" in self.cfg.transfer.transports or split)
        self.region = KVRegion.allocate(
            "kv",
            num_layers,
            num_blocks,
            block_shape,
            dtype,
            device=device,
            shared=shared,
            layout=self.cfg.engine.kv_layout_choice(),
            tensors_per_layer=tensors_per_layer,
        )
        return self.region.tensors

    def info(self) -> V.WorkerInfo:
        e = self.engine
        return V.WorkerInfo(
            address=self.address,
            transfer_address=self.transfer.address,  # advertised by the engine itself
            model=str(e.config.model),
            device=str(e.device),
            max_model_len=e.max_model_len,
            block_size=e.config.block_size,
            num_blocks=e.kv.pool.num_blocks,
            pid=os.getpid(),
            start_layer=e.config.start_layer,
            hidden_size=e.model_config.hidden_size,
            vocab_size=e.model_config.vocab_size,
            fingerprint=self.fingerprint,
            dtype=e.dtype_choice.name,
            dtype_reason=e.dtype_choice.reason,
        )

    def _share_cpus(self, path: str, slot: int) -> None:
        try:
            self.engine.share_cpus(HostBoard(path, slot))
        except (OSError, ValueError) as e:  # it only costs neighbours' latency: run on
            log.warning("%s: no CPU board (%s): threads follow the load alone", self.worker_id, e)

    def _advertised(self, address: str) -> str:
        if not self.cfg.advertise_host:
            return address
        return f"tcp://{self.cfg.advertise_host}:{address.rsplit(':', 1)[1]}"

    # -- main loop -----------------------------------------------------------------------
    def serve_forever(self) -> None:
        while not self.stopped:
            if self.control.poll(self._poll_ms()):
                for ident, msg in self.control.receive():
                    self._contain(ident, msg)
            for ident in self.control.lost():
                self.book.drop_owner(ident)
                self.embeds.drop_owner(ident)
            started = time.monotonic()
            if self.engine.has_unfinished_requests() and self.step_faults.wait_s(started) == 0:
                for out in self.engine.step(self._layer_hook):
                    self.book.on_output(out)
                for failure in self.engine.pop_failures():
                    self.book.on_failure(failure)
                self.step_faults.stepped(started)
            else:
                self.engine.idle()
            self.embeds.step(self.engine, self.control.send)
            self.transfer.progress()
            self.book.tick()
            self.control.flush()
            now = time.monotonic()
            if now - self._last_heartbeat >= self.cfg.heartbeat_s:
                self._heartbeat(now)
            if self.draining and not self.book.busy:
                break
            if self.switch_to is not None and not self.book.busy and not self.book.fencing:
                self._switch_role(self.switch_to)
        self.control.broadcast(P.Bye(worker=self.worker_id))
        self.control.flush()

    def _poll_ms(self) -> int:
        load = self.engine.load()
        if self.embeds.busy:
            return 0  # an embedding pass to run
        if load.waiting or load.running:  # a step to run, at once unless a fault delays it
            wait = self.step_faults.wait_ms(time.monotonic())
            return min(wait, 1) if self.book.busy else wait
        # Only waiting on transfers (remote KV, pushes, fences): check often, without spinning
        # on a core the other worker may need.
        return 1 if self.book.busy else 20

    def _contain(self, ident: bytes, msg: Any) -> None:
        """Handles one message; a bug it triggers ends that request, not the worker."""
        try:
            self._handle(ident, msg)
        except Exception as e:
            log.exception("%s: %s failed", self.worker_id, type(msg).__name__)
            rid = getattr(msg, "rid", "")
            message = (
                f"worker {self.worker_id}: {type(msg).__name__} failed: {type(e).__name__}: {e}"
            )
            self.control.send(ident, P.Error(rid=rid, code=V.ErrorCode.INTERNAL, message=message))
            if rid:
                try:
                    self.book.abort(ident, rid)
                finally:
                    self.engine.abort_request(rid)

    def _handle(self, ident: bytes, msg: Any) -> None:
        match msg:
            case P.Hello():
                self.control.send(
                    ident, P.Ready(worker=self.worker_id, role=self.role, info=self.info())
                )
            case P.Check():
                self.control.send(ident, self._integrity())
            case P.PeerKeys(keys=keys):
                for key in keys:  # ahead of the message that names these peers
                    self.transfer.trust(key.peer, key.key)
            case P.Generate() | P.Reserve() | P.Prefill():
                if self.draining or self.switch_to is not None:
                    message = f"worker {self.worker_id} is draining"
                    self.control.send(
                        ident, P.Error(rid=msg.rid, code=V.ErrorCode.DRAINING, message=message)
                    )
                else:
                    self.book.start(ident, msg)
            case P.OfferPrefix():
                if not shares_prefixes(self.engine):
                    self.control.send(ident, P.PrefixOffered(rid=msg.rid))
                else:
                    self.control.send(ident, offer_prefix(self.engine.kv, self.transfer, msg))
            case P.Embed():
                self.embeds.add(ident, msg)
            case P.Hidden():
                self.book.hidden(ident, msg)
            case P.KvReady():
                self.book.kv_ready(ident, msg)
            case P.KvFailed():
                self.book.kv_failed(ident, msg)
            case P.Abort():
                self.book.abort(ident, msg.rid)
            case M.MigrateIn():
                if self.draining or self.switch_to is not None or self.role == "prefill":
                    why = f"request {msg.rid}: worker {self.worker_id} takes no migration now"
                    self.control.send(ident, M.MigrateFailed(rid=msg.rid, message=why))
                else:
                    self.book.migrations.start_in(ident, msg)
            case M.MigrateResume():
                self.book.migrations.resume_in(ident, msg)
            case M.MigrateOut():
                self.book.migrations.start_out(ident, msg)
            case M.MigrateCancel():
                self.book.migrations.cancel(ident, msg.rid)
            case P.SwitchRole(role=role):
                if self.role == "both":
                    message = f"{self.worker_id} (both) cannot switch to {role}"
                    self.control.send(
                        ident, P.Error(rid="", code=V.ErrorCode.BAD_REQUEST, message=message)
                    )
                elif role != self.role:
                    self.switch_to = role
            case P.Shutdown(drain=drain):
                self.draining = True
                self.stopped = not drain

    def _switch_role(self, role: Role) -> None:
        """Drained (nothing in flight): now serve as `role`, and say so with a new Ready."""
        self.engine.switch_role(role)
        self.role, self.switch_to = role, None
        log.info("%s now serves as %s", self.worker_id, role)
        # A load that no longer drains goes first: the router's view must not keep the
        # draining one of a heartbeat sent while switching, once Ready ends the switch.
        self._heartbeat(time.monotonic(), only_idle=False)
        self.control.broadcast(P.Ready(worker=self.worker_id, role=role, info=self.info()))

    def _layer_hook(self, out: SchedulerOutput) -> Callable[[int], None]:
        """Runs after every layer of a step: layer-wise KV pushes, and heartbeats, so that a
        long step never looks like a dead worker to the router."""
        push = self.book.pushes.layer_hook(out) if self.cfg.layerwise else None

        def on_layer_done(layer: int) -> None:
            if push is not None:
                push(layer)
            now = time.monotonic()
            if now - self._last_heartbeat >= self.cfg.heartbeat_s:
                self._heartbeat(now)

        return on_layer_done

    def _heartbeat(self, now: float, only_idle: bool = True) -> None:
        """Sends the load report (`only_idle`: only to routers with nothing queued)."""
        self._last_heartbeat = now
        self.engine.check_ranks()  # an idle worker notices a dead rank too: it exits
        draining = self.draining or self.switch_to is not None
        report = load_report(self.engine, self.transfer, self.book, self.control.rejected, draining)
        beat = P.Heartbeat(worker=self.worker_id, load=report, cached=self._cache_report(now))
        self.control.broadcast(beat, only_idle=only_idle)
        if not report.transfer_healthy and self.fault is None:
            # Its I/O thread is gone for good: finish what needs no transfer, then exit so
            # the supervisor (or Kubernetes) starts a worker that can move KV again.
            self.fault = f"transfer engine stopped ({self.transfer.health().error})"
            log.error("%s: %s; draining, then exiting to be restarted", self.worker_id, self.fault)
            self.draining = True
        self.book.pushes.renew_reservations()
        self.control.flush()
        if self.cfg.alive_file:
            Path(self.cfg.alive_file).touch()
        if self.cfg.parent_pid and os.getppid() != self.cfg.parent_pid:
            log.error(
                "%s: its launcher (pid %s) is gone; stopping", self.worker_id, self.cfg.parent_pid
            )
            self.draining = self.stopped = True

    def _cache_report(self, now: float) -> V.CachedBlocks | None:
        """The prefix cache's hashes when they changed since the last report, or when that
        is CACHE_REPORT_S old (a heartbeat may be skipped); else None."""
        pool = self.engine.kv.pool
        version, sent = self._reported
        if self.engine.config.start_layer or (
            version == pool.version and now - sent < CACHE_REPORT_S
        ):
            return None
        self._reported = (pool.version, now)
        return V.CachedBlocks.of(pool.version, pool.cached_hashes(V.MAX_REPORTED_BLOCKS))

    def _integrity(self) -> P.Integrity:
        try:
            self.engine.check_integrity()
        except AssertionError as e:
            return P.Integrity(ok=False, used_blocks=-1, message=str(e))
        used = self.engine.load().used_blocks
        busy = self.book.busy or self.book.fencing
        return P.Integrity(ok=True, used_blocks=used, message="busy" if busy else "idle")

    def close(self) -> None:
        self.transfer.close()
        self.control.close()
        self.engine.close()


def run(cfg: WorkerConfig) -> int:
    """Runs one worker in this process until SIGTERM/SIGINT (drain) or its launcher exits."""
    credential = secrets.worker_credential_from_env(cfg.worker_id)
    if cfg.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cfg.cpus)
    if cfg.alive_file:
        Path(cfg.alive_file).parent.mkdir(parents=True, exist_ok=True)
    worker = Worker(cfg, credential)

    def on_term(signum: int, frame: Any) -> None:
        worker.draining = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    ready = msgspec.json.encode({"worker": worker.worker_id, "info": worker.info()}).decode()
    print(f"{READY_LINE} {ready}", flush=True)
    try:
        worker.serve_forever()
    finally:
        worker.close()
    return 1 if worker.fault else 0


def main(argv: list[str] | None = None) -> int:
    """`python -m hetero_pd.serving.worker.main`: one worker in the foreground, its WorkerConfig
    as JSON on stdin and its credential in HETERO_PD_WORKER_KEY."""
    import argparse

    p = argparse.ArgumentParser(prog="hetero-pd worker", description=main.__doc__)
    p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return run(WorkerConfig.from_json(sys.stdin.buffer.read()))


if __name__ == "__main__":
    from hetero_pd.process_exit import exit_after

    exit_after(main)

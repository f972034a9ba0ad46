"""The router: knows the workers, picks them for each request, streams the answer.

A request's way to its decode worker (colocated, local prefill, or the disaggregated
reserve -> prefill -> kv_ready hand-off with its failure policy) is `handoff.start`; this
module keeps the workers (`WorkerClient`s, authenticated with the deployment's control
keys) and turns a decode worker's `Output` messages into the stream a caller iterates.

A split (edge) request carries its prompt as layer k's hidden states (`EdgeRequest`)
instead of token ids; it goes only to workers running layers [k, L), and for every token
the decode worker samples, the edge session hands the router that token's hidden state
(`supply_hidden`), which it forwards to the decode worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from typing import Any

import zmq.asyncio

from hetero_pd.sampling_params import SamplingParams
from hetero_pd.serving.control import migration as M
from hetero_pd.serving.control import protocol as P
from hetero_pd.serving.control import values as V
from hetero_pd.serving.control.auth import RouterKeys
from hetero_pd.serving.router.admission import Admission
from hetero_pd.serving.router.errors import RouterError, worker_error
from hetero_pd.serving.router.handoff import EdgeRequest, Handoff, HandoffPolicy
from hetero_pd.serving.router.inbox import Inbox, next_message
from hetero_pd.serving.router.metrics import ServingMetrics
from hetero_pd.serving.router.migration import Migrator, Stream
from hetero_pd.serving.router.policy import Chooser, FailurePolicy, RoutingConfig
from hetero_pd.serving.router.rebalance import RebalanceConfig, Rebalancer
from hetero_pd.serving.router.worker_client import WorkerClient, WorkerGone, WorkerUnreachable

log = logging.getLogger("hetero_pd.router")

__all__ = ["EdgeRequest", "Router", "RouterConfig", "RouterError"]


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """The router's settings (a deployment's `router:` section checks them: RouterSpec)."""

    routing: RoutingConfig = field(default_factory=RoutingConfig)
    failure_policy: FailurePolicy = "recompute"
    max_retries: int = 2
    #: Completions in flight (each request's prompts x n), in all and per API key (0: as
    #: many as max_inflight); above either, a 429.
    max_inflight: int = 256
    max_inflight_per_key: int = 0
    reserve_timeout_s: float = 30.0
    prefill_timeout_s: float = 120.0
    token_timeout_s: float = 120.0  # longest silence between two outputs of one request
    heartbeat_timeout_s: float = 5.0
    #: Moving requests off a decode worker whose KV is nearly full (off by default).
    rebalance: RebalanceConfig = field(default_factory=RebalanceConfig)


class Router:
    def __init__(
        self, cfg: RouterConfig, keys: RouterKeys, metrics: ServingMetrics | None = None
    ) -> None:
        self.cfg = cfg
        self.keys = keys
        self.metrics = metrics or ServingMetrics()
        self.ctx = zmq.asyncio.Context()
        self.workers: dict[str, WorkerClient] = {}
        self.chooser = Chooser(cfg.routing)
        self.queues: dict[str, Inbox] = {}
        self.admission = Admission(cfg.max_inflight, cfg.max_inflight_per_key or cfg.max_inflight)
        self._switching: set[str] = set()
        #: Requests streaming from their decode workers, and their live migrations.
        self.streams: dict[str, Stream] = {}
        self.migrator = Migrator(
            self.streams, self.workers, self.metrics, lambda: self.live("decode", "both")
        )
        #: Serve runs `rebalancer.run()` when cfg.rebalance.enabled.
        self.rebalancer = Rebalancer(
            cfg.rebalance, self.migrator, lambda: self.live("decode", "both")
        )
        self._evacuations: set[asyncio.Task[Any]] = set()  # of workers stopping
        self._decoder: dict[str, WorkerClient] = {}  # split request id -> its decode worker
        #: Supervisor's view of each worker process (pid, restarts, state) for /health.
        self._supervision: Mapping[str, Mapping[str, Any]] = {}
        self.handoff_policy = HandoffPolicy(
            cfg.max_retries,
            cfg.failure_policy,
            cfg.reserve_timeout_s,
            cfg.prefill_timeout_s,
            self.chooser,
            self.metrics,
            self.live,
        )

    # -- workers -------------------------------------------------------------------------
    async def add_worker(self, worker_id: str, address: str, timeout_s: float = 120.0) -> None:
        """Connects to `worker_id` at `address` (replacing its previous handle: the worker
        stays listed, with its role and info and not alive, until the new one says hello)."""
        client = WorkerClient(
            worker_id,
            address,
            self.ctx,
            self.keys,
            self._on_message,
            self._on_dead,
            self.cfg.heartbeat_timeout_s,
        )
        old = self.workers.get(worker_id)
        self.workers[worker_id] = client
        if old is not None:
            client.role, client.info = old.role, old.info
            self._on_dead(old)
            await old.close()
        await client.start(timeout_s)

    async def close(self, flush_s: float = 0.0) -> None:
        """Closes every worker's socket; with `flush_s`, after one round trip to each live
        worker (at most that long): the sockets drop what they have not sent, and workers
        that outlive the router (several hosts) must first read the aborts of the requests
        a shutdown cut (one worker's messages stay in order: its answer means they were)."""
        for task in self._evacuations:
            task.cancel()
        if flush_s > 0:
            live = [w for w in self.workers.values() if w.alive]
            await asyncio.gather(*(w.flush(flush_s) for w in live))
        for client in self.workers.values():
            await client.close()
        self.ctx.term()

    def follow_supervision(self, states: Mapping[str, Mapping[str, Any]]) -> None:
        """Where the supervisor keeps each worker process's state (pid, restarts, running,
        restarting or down); /health shows it."""
        self._supervision = states

    def supervision_of(self, worker_id: str) -> dict[str, Any]:
        """The supervisor's state of `worker_id`'s process ({} without a supervisor)."""
        return dict(self._supervision.get(worker_id, {}))

    def live(self, *roles: str, split_layer: int | None = None) -> list[WorkerClient]:
        """Live workers in `roles`; with `split_layer`, only those that start at that layer
        (0: whole-model workers)."""
        return [
            w
            for w in self.workers.values()
            if w.alive
            and w.role in roles
            and w.worker_id not in self._switching
            and w.worker_id not in self.migrator.draining
            and (split_layer is None or w.start_layer == split_layer)
        ]

    def split_info(self) -> tuple[int, str, int] | None:
        """(split layer, fingerprint, hidden size) of this deployment's split workers, or
        None when it runs whole-model workers."""
        for w in self.workers.values():
            if w.start_layer:
                return w.start_layer, w.info.fingerprint, w.info.hidden_size
        return None

    async def switch_role(self, worker_id: str, role: str, timeout_s: float = 300.0) -> None:
        """Drains `worker_id` (no new requests; a decode worker's decoding requests migrate to
        the other decode workers, the rest finish) and switches it between prefill and
        decode; it is back in rotation in its new role when this returns."""
        client = self.workers.get(worker_id)
        if client is None or not client.alive:
            raise ValueError(f"no live worker {worker_id!r}")
        if role not in ("prefill", "decode") or client.role not in ("prefill", "decode"):
            raise ValueError(f"{worker_id} ({client.role}) cannot switch to {role!r}")
        if client.role == role:
            return
        remaining = [w for w in self.live(client.role) if w.worker_id != worker_id]
        if not remaining:
            raise ValueError(f"{worker_id} is the last {client.role} worker")
        self._switching.add(worker_id)
        try:
            if client.role == "decode":  # its decoding requests move instead of finishing
                await self.migrator.drain(worker_id, timeout_s)
            await client.switch_role(role, timeout_s)
        finally:
            self._switching.discard(worker_id)
            self.migrator.undrain(worker_id)
        log.info("worker %s now serves as %s", worker_id, role)

    def mark_dead(self, worker_id: str) -> None:
        """The supervisor saw the process exit: take it out of rotation at once."""
        client = self.workers.get(worker_id)
        if client is not None and not client.gone:
            client.mark_gone("process exited")

    def silent_for(self, worker_id: str) -> float | None:
        """Seconds since the worker was last heard from (None: never, or unknown)."""
        client = self.workers.get(worker_id)
        if client is None or not client.last_seen:
            return None
        return time.monotonic() - client.last_seen

    def _on_message(self, client: WorkerClient, msg: Any) -> None:
        if isinstance(msg, P.Heartbeat):  # the first saying it drains
            self._evacuate(client)
            return
        if isinstance(msg, M.MigrateReady | M.MigrateState | M.MigrateFailed | M.Migrated):
            self.migrator.deliver(client.worker_id, msg)
            if not isinstance(msg, M.Migrated):  # Migrated switches the stream as well
                return
        queue = self.queues.get(getattr(msg, "rid", ""))
        if queue is not None:
            queue.put_nowait((client.worker_id, msg))

    def _evacuate(self, client: WorkerClient) -> None:
        """A decode worker drains of its own accord (told to stop: SIGTERM, a Kubernetes
        pod's termination): its decoding requests move to the other decode workers before
        it exits, so stopping a pod needs no operator key in it. A drain the router runs
        itself (admin, restart, role switch) moves them already."""
        if client.role not in ("decode", "both") or client.worker_id in self.migrator.draining:
            return
        log.info("worker %s is stopping: moving its requests", client.worker_id)
        task = asyncio.create_task(self.migrator.evacuate(client.worker_id, reason="shutdown"))
        self._evacuations.add(task)
        task.add_done_callback(self._evacuations.discard)

    def _on_dead(self, client: WorkerClient) -> None:
        self.migrator.deliver(client.worker_id, WorkerGone(client.worker_id))
        for rid in list(client.inflight):
            queue = self.queues.get(rid)
            if queue is not None:
                queue.put_nowait((client.worker_id, WorkerGone(client.worker_id)))
        self.metrics.set_worker(client.worker_id, client.role, 0, 0, 0.0, False)

    def refresh_metrics(self) -> None:
        for w in self.workers.values():
            load = w.load
            queued = load.waiting + load.remote
            self.metrics.set_worker(
                w.worker_id,
                w.role,
                queued,
                load.running,
                load.kv_usage,
                w.alive,
                load.frames_rejected,
                load.transfer_auth_failures,
            )
            self.metrics.spec_decode.set(w.worker_id, load.spec_decode)

    # -- requests ------------------------------------------------------------------------
    async def generate(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        edge: EdgeRequest | None = None,
        admitted: bool = False,
    ) -> AsyncGenerator[P.Output, None]:
        """Yields the decode worker's `Output` messages until each of the request's `n`
        completions (`Output.index`) has had one with a finish reason.

        Unless the caller `admitted` them (`self.admission`, e.g. for a whole batch and its
        API key), the `n` completions are admitted here, without a key; a 429 when full.
        With `edge`, the prompt is hidden states for workers starting at its layer
        (`prompt_ids` is empty), and each token needs `supply_hidden` before the next."""
        layer = edge.worker_layer if edge is not None else 0
        if not self.live("decode", "both", split_layer=layer):
            what = f"for split layer {layer}" if layer else "running the whole model"
            raise RouterError(503, f"no decode-capable worker {what} is alive", "no_workers", 2.0)
        slots = None if admitted else self.admission.admit("", params.n)
        queue: Inbox = asyncio.Queue()
        self.queues[rid] = queue
        flow = Handoff(self.handoff_policy, rid, prompt_ids, params, priority, queue, edge)
        migratable = edge is None
        finished = False
        running = set(range(params.n))  # completions without a finish reason yet
        try:
            decode, early = await flow.start()
            if edge is not None and edge.prompt.early_kv is None:
                self._decoder[rid] = decode
            stream = self.streams[rid] = Stream(
                rid, decode, prompt_ids, flow.params, priority, flow.involved, migratable,
                running,
            )  # fmt: skip
            expected = 0
            while True:
                if early is not None:
                    worker_id, msg, early = decode.worker_id, early, None
                else:
                    worker_id, msg = await next_message(queue, self.cfg.token_timeout_s, rid)
                if isinstance(msg, M.Migrated) and stream.switch(worker_id):
                    decode = stream.decode  # its outputs follow on the same socket
                if worker_id != decode.worker_id:
                    continue
                match msg:
                    case WorkerGone() if stream.handing_over:
                        pass  # the request is paused there, its state on the way to dest
                    case WorkerGone():
                        raise RouterError(
                            503, f"decode worker {worker_id} died mid-request", "worker_died"
                        )
                    case P.Error():
                        raise worker_error(msg)
                    case P.KvFallback():
                        log.warning("request %s: %s computes the prompt itself", rid, worker_id)
                        self.metrics.decision("recompute")
                    case P.Output():
                        flow.prompt_done()
                        check_output(rid, worker_id, msg, expected, params.n)
                        expected += 1
                        stream.decoding = True
                        stream.tokens = max(stream.tokens, msg.completion_tokens)
                        if msg.finish_reason is not None:
                            running.discard(msg.index)
                        finished = not running
                        yield msg
                        if finished:
                            return
        finally:
            if slots is not None:
                slots.release()
            flow.prompt_done()
            self.queues.pop(rid, None)
            self.streams.pop(rid, None)
            self._decoder.pop(rid, None)
            for w in flow.involved:
                w.inflight.pop(rid, None)
                if not finished:
                    w.try_send(P.Abort(rid=rid))

    async def embed(self, rid: str, inputs: list[list[int]]) -> tuple[int, bytes]:
        """(dim, float32 rows) of `inputs`' embeddings, computed by the least loaded
        whole-model worker that computes prompts (a prefill worker, else a colocated one)."""
        workers = self.live("prefill", split_layer=0) or self.live("both", split_layer=0)
        if not workers:
            raise RouterError(503, "no whole-model prefill or colocated worker is alive",
                              "no_workers", 2.0)  # fmt: skip
        worker = min(workers, key=lambda w: w.load_score)
        queue: Inbox = asyncio.Queue()
        self.queues[rid] = queue
        worker.inflight[rid] = None  # it decodes nothing
        try:
            worker.send(P.Embed(rid=rid, inputs=inputs))
            while True:
                worker_id, msg = await next_message(queue, self.cfg.prefill_timeout_s, rid)
                match msg:
                    case P.Embedded() if worker_id == worker.worker_id:
                        return msg.dim, msg.vectors
                    case P.Error() if worker_id == worker.worker_id:
                        raise worker_error(msg)
                    case WorkerGone() if worker_id == worker.worker_id:
                        raise RouterError(
                            503, f"worker {worker_id} died mid-request", "worker_died"
                        )
        except WorkerUnreachable as e:
            raise RouterError(503, str(e), "worker_unreachable", 2.0) from None
        finally:
            self.queues.pop(rid, None)
            worker.inflight.pop(rid, None)

    def supply_hidden(self, rid: str, frame: V.HiddenFrame) -> None:
        """Forwards an edge device's hidden state for split request `rid`'s newest token."""
        decode = self._decoder.get(rid)
        if decode is None:
            raise RouterError(400, f"no split request {rid} is decoding", "unknown_request")
        try:
            decode.send(P.Hidden(rid=rid, frame=frame))
        except WorkerUnreachable as e:
            raise RouterError(503, str(e), "worker_unreachable", 2.0) from None


def check_output(rid: str, worker_id: str, msg: P.Output, expected: int, n: int) -> None:
    """An output must be the next of its request (none lost) and of one of its completions."""
    if msg.seq != expected:
        raise RouterError(
            502,
            f"request {rid}: output {expected} from {worker_id} was lost (got output {msg.seq}); "
            "refusing to return an incomplete answer",
            "lost_output",
        )
    if msg.index >= n:
        raise RouterError(
            502,
            f"request {rid}: {worker_id} answered for completion {msg.index} of {n}",
            "bad_output",
        )

"""The router: picks workers for each request and runs the disaggregated flow.

    router            decode D                 prefill P
      |-- reserve ------>| reserve blocks
      |<-- reserved -----| (block ids + epoch)
      |-- prefill (dest = D's blocks) ---------->| prefill, push KV (layer-wise optional)
      |                  |<======= KV blocks ====| checksum, ACK
      |<-- prefill_done (first token) -----------| frees its blocks after the ACK
      |-- kv_ready ----->| joins the decode batch
      |<-- output ... ---| tokens stream to the client

A split (edge) request carries its prompt as layer k's hidden states (a codec frame) instead
of token ids; it goes only to workers running layers [k, L), and for every token the decode
worker samples, the edge session hands the router that token's hidden state
(`supply_hidden`), which it forwards to the decode worker.

On a prefill failure the deployment's policy decides: `recompute` (D prefills itself),
`retry` (a fresh reservation and another P), or `fail` (a clear error). A client that goes
away aborts the request on every worker involved.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import zmq.asyncio

from hetero_pd.sampling_params import SamplingParams
from hetero_pd.serving import messages as M
from hetero_pd.serving.policy import FAILURE_POLICIES, Chooser, FailurePolicy, RoutingConfig
from hetero_pd.serving.prom import ServingMetrics
from hetero_pd.serving.worker_client import WorkerClient

log = logging.getLogger("hetero_pd.router")
DEAD = "__dead__"
T = TypeVar("T")
#: Decode-worker answers to `reserve` that mean "not now": back off and ask again.
BACKPRESSURE = ("NO_FREE_BLOCKS", "KV_FENCED")


@dataclass(frozen=True, slots=True)
class SplitPrompt:
    """A prompt from an edge device: layer `layer`'s input for `num_tokens` tokens, as a
    `hetero_pd.hidden_codec` frame the workers decode. With `early_kv` (the KV of the
    device's layers [0, layer), "prompt only" mode) it goes to whole-model workers, which
    then decode alone; without, to split workers starting at `layer`."""

    layer: int
    frame: dict[str, Any]
    num_tokens: int
    early_kv: dict[str, Any] | None = None

    @property
    def worker_layer(self) -> int:
        """The start layer of the workers that serve it."""
        return 0 if self.early_kv is not None else self.layer

    def fields(self) -> dict[str, Any]:
        """The fields it adds to generate/reserve/prefill messages."""
        if self.early_kv is None:
            return {"hidden": self.frame}
        return {"hidden": self.frame, "early_kv": self.early_kv, "early_layers": self.layer}


class RouterError(Exception):
    """A request the router cannot serve; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str, code: str, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.retry_after = status, message, code, retry_after


@dataclass(frozen=True, slots=True)
class RouterConfig:
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    failure_policy: FailurePolicy = "recompute"
    max_retries: int = 2
    max_inflight: int = 256
    reserve_timeout_s: float = 30.0
    prefill_timeout_s: float = 120.0
    token_timeout_s: float = 120.0  # longest silence between two outputs of one request
    heartbeat_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.failure_policy not in FAILURE_POLICIES:
            raise ValueError(
                f"failure_policy must be one of {FAILURE_POLICIES}, got {self.failure_policy!r}"
            )


class Router:
    def __init__(self, cfg: RouterConfig, metrics: ServingMetrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics or ServingMetrics()
        self.ctx = zmq.asyncio.Context()
        self.workers: dict[str, WorkerClient] = {}
        self.chooser = Chooser(cfg.routing)
        self._queues: dict[str, asyncio.Queue[tuple[str, dict[str, Any]]]] = {}
        self._switching: set[str] = set()
        self._decoder: dict[str, WorkerClient] = {}  # split request id -> its decode worker
        #: Supervisor's view of each worker process (pid, restarts, state) for /health.
        self.supervision: dict[str, dict[str, Any]] = {}

    # -- workers -------------------------------------------------------------------------
    async def add_worker(self, worker_id: str, address: str, timeout_s: float = 120.0) -> None:
        old = self.workers.pop(worker_id, None)
        if old is not None:
            self._on_dead(old)
            await old.close()
        client = WorkerClient(
            worker_id,
            address,
            self.ctx,
            self._on_message,
            self._on_dead,
            self.cfg.heartbeat_timeout_s,
        )
        self.workers[worker_id] = client
        await client.start(timeout_s)

    async def close(self) -> None:
        for client in self.workers.values():
            await client.close()
        self.ctx.term()

    def live(self, *roles: str, split_layer: int | None = None) -> list[WorkerClient]:
        """Live workers in `roles`; with `split_layer`, only those that start at that layer
        (0: whole-model workers)."""
        return [
            w
            for w in self.workers.values()
            if w.alive
            and w.role in roles
            and w.id not in self._switching
            and (split_layer is None or int(w.info.get("start_layer", 0)) == split_layer)
        ]

    def split_info(self) -> tuple[int, str, int] | None:
        """(split layer, fingerprint, hidden size) of this deployment's split workers, or
        None when it runs whole-model workers."""
        for w in self.workers.values():
            start = int(w.info.get("start_layer", 0))
            if start:
                return start, str(w.info.get("fingerprint", "")), int(w.info["hidden_size"])
        return None

    async def switch_role(self, worker_id: str, role: str, timeout_s: float = 300.0) -> None:
        """Drains `worker_id` (no new requests; in-flight ones finish) and switches it between
        prefill and decode; it is back in rotation in its new role when this returns."""
        client = self.workers.get(worker_id)
        if client is None or not client.alive:
            raise ValueError(f"no live worker {worker_id!r}")
        if role not in ("prefill", "decode") or client.role not in ("prefill", "decode"):
            raise ValueError(f"{worker_id} ({client.role}) cannot switch to {role!r}")
        if client.role == role:
            return
        remaining = [w for w in self.live(client.role) if w.id != worker_id]
        if not remaining:
            raise ValueError(f"{worker_id} is the last {client.role} worker")
        self._switching.add(worker_id)
        try:
            await client.switch_role(role, timeout_s)
        finally:
            self._switching.discard(worker_id)
        log.info("worker %s now serves as %s", worker_id, role)

    def mark_dead(self, worker_id: str) -> None:
        """The supervisor saw the process exit: take it out of rotation at once."""
        client = self.workers.get(worker_id)
        if client is not None and not client.gone:
            client.mark_gone("process exited")

    def _on_message(self, client: WorkerClient, msg: dict[str, Any]) -> None:
        queue = self._queues.get(msg.get("rid", ""))
        if queue is not None:
            queue.put_nowait((client.id, msg))

    def _on_dead(self, client: WorkerClient) -> None:
        for rid in list(client.inflight):
            queue = self._queues.get(rid)
            if queue is not None:
                queue.put_nowait((client.id, {"t": DEAD}))
        self.metrics.set_worker(client.id, client.role, 0, 0, 0.0, False)

    def refresh_metrics(self) -> None:
        for w in self.workers.values():
            load = w.load
            queued = int(load.get("waiting", 0)) + int(load.get("remote", 0))
            self.metrics.set_worker(
                w.id,
                w.role,
                queued,
                int(load.get("running", 0)),
                float(load.get("kv_usage", 0.0)),
                w.alive,
            )

    # -- requests ------------------------------------------------------------------------
    async def generate(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        split: SplitPrompt | None = None,
    ) -> AsyncGenerator[dict[str, Any], None]:
        """Yields the decode worker's `output` messages until one carries a finish reason.

        With `split`, the prompt is hidden states for workers starting at `split.layer`
        (`prompt_ids` is empty), and each token needs `supply_hidden` before the next."""
        if len(self._queues) >= self.cfg.max_inflight:
            raise RouterError(429, "the server is at capacity; retry shortly", "overloaded", 1.0)
        layer = split.worker_layer if split is not None else 0
        decoders = self.live("decode", "both", split_layer=layer)
        if not decoders:
            what = f"for split layer {layer}" if layer else "running the whole model"
            raise RouterError(503, f"no decode-capable worker {what} is alive", "no_workers", 2.0)
        queue: asyncio.Queue[tuple[str, dict[str, Any]]] = asyncio.Queue()
        self._queues[rid] = queue
        involved: list[WorkerClient] = []
        finished = False
        try:
            decode, early = await self._start(
                rid, prompt_ids, params, priority, queue, involved, split
            )
            if split is not None and split.early_kv is None:
                self._decoder[rid] = decode
            while True:
                if early is not None:
                    wid, msg, early = decode.id, early, None
                else:
                    wid, msg = await self._next(queue, self.cfg.token_timeout_s, rid)
                if msg["t"] == DEAD and wid == decode.id:
                    raise RouterError(503, f"decode worker {wid} died mid-request", "worker_died")
                if msg["t"] == "error" and wid == decode.id:
                    raise _worker_error(msg)
                if msg["t"] == "kv_fallback" and wid == decode.id:
                    log.warning("request %s: %s computes the prompt itself", rid, decode.id)
                    self.metrics.decision("recompute")
                if msg["t"] == "output" and wid == decode.id:
                    finished = msg["finish_reason"] is not None
                    yield msg
                    if finished:
                        return
        finally:
            self._queues.pop(rid, None)
            self._decoder.pop(rid, None)
            for w in involved:
                w.inflight.discard(rid)
                if not finished:
                    w.send("abort", rid=rid)

    def supply_hidden(self, rid: str, frame: dict[str, Any]) -> None:
        """Forwards an edge device's hidden state for split request `rid`'s newest token."""
        decode = self._decoder.get(rid)
        if decode is None:
            raise RouterError(400, f"no split request {rid} is decoding", "unknown_request")
        decode.send("hidden", rid=rid, frame=frame)

    async def _next(
        self, queue: asyncio.Queue[tuple[str, dict[str, Any]]], timeout_s: float, rid: str
    ) -> tuple[str, dict[str, Any]]:
        try:
            return await _get_within(queue, timeout_s)
        except TimeoutError:
            raise RouterError(
                504, f"request {rid}: no progress for {timeout_s}s", "timeout"
            ) from None

    async def _start(
        self,
        rid: str,
        prompt_ids: list[int],
        params: SamplingParams,
        priority: int,
        queue: asyncio.Queue[tuple[str, dict[str, Any]]],
        involved: list[WorkerClient],
        split: SplitPrompt | None = None,
    ) -> tuple[WorkerClient, dict[str, Any] | None]:
        """Gets the prompt's KV onto a decode worker; returns that worker and, when it already
        answered (it stopped waiting for the KV and computed the prompt), its first output."""
        wire = M.params_to_wire(params)
        layer, extra = 0, {}
        prompt_len = len(prompt_ids)
        if split is not None:
            layer, extra, prompt_len = split.worker_layer, split.fields(), split.num_tokens
        decode, cached = self.chooser.pick(
            self.live("decode", "both", split_layer=layer), prompt_ids
        )
        prefill = self.live("prefill", split_layer=layer)
        self._enlist(decode, rid, involved)
        self.chooser.record(decode, prompt_ids)
        if decode.role == "both" or self.chooser.prefill_locally(prompt_len, cached, prefill):
            self.metrics.decision("colocated" if decode.role == "both" else "local_prefill")
            decode.send(
                "generate", rid=rid, prompt_ids=prompt_ids, params=wire, priority=priority, **extra
            )
            return decode, None
        self.metrics.decision("disaggregated")
        tried: set[str] = set()
        for attempt in range(self.cfg.max_retries + 1):
            blocks = await self._reserve(decode, rid, prompt_ids, wire, priority, queue, extra)
            live = self.live("prefill", split_layer=layer)
            # Another prefill worker if there is one, else the same one again; never a dead
            # one (nothing would ever answer for it).
            candidates = [w for w in live if w.id not in tried] or live
            if not candidates:
                break
            worker, _ = self.chooser.pick(candidates, prompt_ids)
            tried.add(worker.id)
            self._enlist(worker, rid, involved)
            worker.send(
                "prefill",
                rid=rid,
                prompt_ids=prompt_ids,
                params=wire,
                priority=priority,
                dest_worker=decode.id,
                dest_address=decode.info["transfer_address"],
                dest_blocks=blocks,
                **extra,
            )
            outcome = await self._await_prefill(worker, decode, rid, queue)
            worker.inflight.discard(rid)
            if isinstance(outcome, int):
                decode.send("kv_ready", rid=rid, first_token=outcome)
                return decode, None
            worker.send("abort", rid=rid)  # e.g. after a timeout: stop it computing for nothing
            if isinstance(outcome, dict):
                log.warning("request %s: %s gave up waiting for the KV", rid, decode.id)
                self.metrics.decision("recompute")
                return decode, outcome
            log.warning("request %s: prefill on %s failed: %s", rid, worker.id, outcome)
            self.metrics.transfer_failure(outcome.split(":", 1)[0])
            policy = self.cfg.failure_policy
            if policy == "fail":
                self.metrics.decision("fail")
                raise RouterError(503, f"prefill failed ({outcome})", "prefill_failed")
            if policy == "recompute" or attempt == self.cfg.max_retries:
                break
            self.metrics.decision("retry")
            decode.send("abort", rid=rid)  # a fresh reservation: a new epoch for the retry
        self.metrics.decision("recompute")
        decode.send("kv_failed", rid=rid)
        return decode, None

    def _enlist(self, worker: WorkerClient, rid: str, involved: list[WorkerClient]) -> None:
        worker.inflight.add(rid)
        if worker not in involved:
            involved.append(worker)

    async def _reserve(
        self,
        decode: WorkerClient,
        rid: str,
        prompt_ids: list[int],
        wire: dict[str, Any],
        priority: int,
        queue: asyncio.Queue[tuple[str, dict[str, Any]]],
        extra: dict[str, Any],
    ) -> dict[str, Any]:
        deadline = time.monotonic() + self.cfg.reserve_timeout_s
        delay = 0.05
        while True:
            decode.send(
                "reserve", rid=rid, prompt_ids=prompt_ids, params=wire, priority=priority, **extra
            )
            while True:
                wid, msg = await self._next(queue, max(deadline - time.monotonic(), 0.01), rid)
                if wid != decode.id:
                    continue
                if msg["t"] == DEAD:
                    raise RouterError(503, f"decode worker {wid} died", "worker_died")
                if msg["t"] in ("reserved", "error"):
                    break
            if msg["t"] == "reserved":
                return dict(msg["blocks"])
            if msg["code"] not in BACKPRESSURE:
                raise _worker_error(msg, default_status=503)
            if time.monotonic() + delay > deadline:
                raise RouterError(429, "no KV cache room on the decode workers", "overloaded", 1.0)
            await asyncio.sleep(delay)  # back-pressure: decode is full, wait for room
            delay = min(delay * 2, 1.0)

    async def _await_prefill(
        self,
        prefill: WorkerClient,
        decode: WorkerClient,
        rid: str,
        queue: asyncio.Queue[tuple[str, dict[str, Any]]],
    ) -> int | str | dict[str, Any]:
        """The first token, a string saying why the prefill failed, or the decode worker's
        first output when it stopped waiting (its reservation expired: it computes the
        prompt itself, and what it streams is the answer)."""
        deadline = time.monotonic() + self.cfg.prefill_timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return "TIMEOUT: no prefill result"
            try:
                wid, msg = await _get_within(queue, left)
            except TimeoutError:
                return "TIMEOUT: no prefill result"
            if wid == decode.id:
                if msg["t"] == DEAD:
                    raise RouterError(503, f"decode worker {wid} died", "worker_died")
                if msg["t"] == "error":
                    raise _worker_error(msg)
                if msg["t"] == "output":
                    return msg
                continue
            if wid != prefill.id:
                continue
            if msg["t"] == DEAD:
                return f"WORKER_DIED: prefill worker {wid} died"
            if msg["t"] == "error":
                if msg["code"] == "BAD_REQUEST":
                    raise _worker_error(msg)
                return f"{msg['code']}: {msg['message']}"
            if msg["t"] == "prefill_done":
                stats = msg["transfer"]
                self.metrics.observe_transfer(
                    "kv", int(stats.get("bytes", 0)), float(stats.get("seconds", 0.0))
                )
                return int(msg["first_token"])


def _worker_error(msg: dict[str, Any], default_status: int = 500) -> RouterError:
    """The HTTP-facing error for a worker's `error` message."""
    code = msg["code"]
    status = {"BAD_REQUEST": 400, "DRAINING": 503}.get(code, default_status)
    return RouterError(status, msg["message"], code.lower(), 2.0 if status == 503 else None)


async def _get_within(queue: asyncio.Queue[T], timeout_s: float) -> T:
    """`queue.get()` with a deadline (TimeoutError). Not `asyncio.wait_for`: before Python
    3.12 it returns the item and swallows a cancellation that lands as the item arrives,
    so a client disconnect during a fast token stream could go unnoticed and the request
    would run to the end."""
    async with asyncio.timeout(timeout_s):
        return await queue.get()

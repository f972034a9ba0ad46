"""Every request on a worker, each one object with an explicit state: `RequestBook`.

    generate ──> RUNNING ─────────────────────────────────────────> (finished: gone)
    reserve  ──> RESERVED ──kv_ready, KV whole──> LANDED ──────────> (finished: gone)
                    │ kv_failed, KV not whole, reservation expired
                    └──> FALLBACK (computes the prompt here) ───────> (finished: gone)
    prefill  ──> PREFILLING ──prompt done, KV pushed and ACKed──> (prefill_done: gone)
    migrate  ──> ARRIVING ──state valid──> RUNNING (live migration: migration.py)
    any      ──abort / router lost──> released; while a direct writer may still write into
                                      its blocks: FENCED ──fence over──> (gone)

The book owns the transitions and the replies they cause; the worker's loop only feeds it
messages, engine outputs and the clock. It needs no socket and no model: the engine and
the transfer engine are its collaborators, and replies go out through `send`. How a new
request enters the engine (reservation, push target) is admission.py's.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

from hetero_pd.engine.health import RequestFailure
from hetero_pd.engine.llm_engine import LLMEngine
from hetero_pd.outputs import RequestOutput
from hetero_pd.serving.control import protocol as P
from hetero_pd.serving.control import sampling as W
from hetero_pd.serving.control import values as V
from hetero_pd.serving.worker import admission
from hetero_pd.serving.worker.edge_inputs import decode_frame
from hetero_pd.serving.worker.migration import Migrations
from hetero_pd.serving.worker.prefill_push import PushTracker
from hetero_pd.serving.worker.prefix_share import PrefixPulls
from hetero_pd.serving.worker.request import (
    Phase,
    RequestError,
    WorkerRequest,
    check_endpoint,
    fanout_for,
    output_message,
    prefill_done,
)
from transfer import TransferEngine, TransferError, TransferState

log = logging.getLogger("hetero_pd.worker")
Send = Callable[[bytes, Any], None]


class RequestBook:
    def __init__(
        self,
        worker_id: str,
        engine: LLMEngine,
        transfer: TransferEngine,
        send: Send,
        remote_kv_timeout_s: float,
        layerwise: bool = False,
    ) -> None:
        self.worker_id = worker_id
        self.engine = engine
        self.transfer = transfer
        self.send = send
        self.remote_kv_timeout_s = remote_kv_timeout_s
        self.layerwise = layerwise
        self.pushes = PushTracker(transfer, engine, self._on_push_result)
        #: Requests pulling their prompt's prefix KV from another worker before they start.
        self.pulls = PrefixPulls(worker_id, engine, transfer)
        self.requests: dict[str, WorkerRequest] = {}
        self.children: dict[str, str] = {}  # engine id of completion 1.. of n -> request id
        #: Live migrations of decoding requests, out of this worker and into it.
        self.migrations = Migrations(
            engine,
            transfer,
            send,
            self.requests,
            self.children,
            lambda req: self._drop(req, self.engine.abort_request),
            remote_kv_timeout_s,
        )
        #: Reserved prompts whose KV never arrived whole, so this worker computed them.
        self.kv_fallbacks = 0

    # -- state ---------------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        """Work is left: the engine's, a push, or a request not merely waiting out a fence."""
        return (
            self.engine.has_unfinished_requests()
            or self.pushes.active
            or self.pulls.active
            or any(r.phase is not Phase.FENCED for r in self.requests.values())
        )

    @property
    def fencing(self) -> bool:
        """Blocks are fenced: they may not be reused yet (a stopping worker need not wait)."""
        return any(r.phase is Phase.FENCED for r in self.requests.values())

    def count(self, phase: Phase) -> int:
        return sum(r.phase is phase for r in self.requests.values())

    # -- starting requests ---------------------------------------------------------------
    def start(self, owner: bytes, msg: P.Generate | P.Reserve | P.Prefill) -> None:
        """A new request from router `owner`; a refusal is answered with an Error. A
        request with a prefix to pull starts once the pull ended (prefix_share.py)."""
        old = self.requests.get(msg.rid)
        with self._answering(owner, msg.rid):
            if old is not None and old.phase is Phase.FENCED:
                wait = old.fence_until - time.monotonic()
                raise RequestError(
                    V.ErrorCode.KV_FENCED,
                    f"request {msg.rid}: its previous blocks are fenced for {wait:.2f}s",
                )
            if old is not None or msg.rid in self.pulls:
                raise RequestError(V.ErrorCode.BAD_REQUEST, f"request {msg.rid} is running")
            admission.check_role(self.worker_id, self.engine, msg)
            if isinstance(msg, P.Reserve) or not self.pulls.begin(owner, msg, self._resume):
                self._open(owner, msg)

    def _resume(self, owner: bytes, msg: P.Generate | P.Prefill) -> None:
        with self._answering(owner, msg.rid):
            self._open(owner, msg)

    @contextlib.contextmanager
    def _answering(self, owner: bytes, rid: str) -> Iterator[None]:
        """Answers a refusal of request `rid` with an Error."""
        try:
            yield
        except RequestError as e:
            code, message, status = e.code, e.message, e.transfer_status
            self.send(owner, P.Error(rid=rid, code=code, message=message, transfer_status=status))
        except (ValueError, TypeError, KeyError) as e:
            self.send(owner, P.Error(rid=rid, code=V.ErrorCode.BAD_REQUEST, message=str(e)))

    def _open(self, owner: bytes, msg: P.Generate | P.Reserve | P.Prefill) -> None:
        params = msg.params.to_params()
        fanout = fanout_for(msg, params)
        first = fanout.child_params(0) if fanout is not None else params
        if isinstance(msg, P.Reserve):
            self._reserve(owner, msg, first)
        elif isinstance(msg, P.Prefill):
            self._prefill(owner, msg, first)
        else:
            admission.add(self.engine, self.worker_id, msg, first)
            self.requests[msg.rid] = WorkerRequest(msg.rid, owner, Phase.RUNNING)
        if fanout is not None:
            req = self.requests[msg.rid]
            req.fanout, req.prompt_ids, req.priority = fanout, msg.prompt_ids, msg.priority

    def _reserve(self, owner: bytes, msg: P.Reserve, params: Any) -> None:
        timeout_s = self.remote_kv_timeout_s
        handle, reply = admission.reserve(
            self.engine, self.transfer, self.worker_id, msg, params, timeout_s
        )
        self.requests[msg.rid] = WorkerRequest(msg.rid, owner, Phase.RESERVED, handle=handle)
        self.send(owner, reply)

    def _prefill(self, owner: bytes, msg: P.Prefill, params: Any) -> None:
        check_endpoint(msg.dest_address)
        dest, skip_blocks = admission.push_target(self.engine, self.transfer, msg)
        admission.add(self.engine, self.worker_id, msg, params)
        self.pushes.expect(msg.rid, msg.dest_worker_id, dest, skip_blocks)
        self.requests[msg.rid] = WorkerRequest(msg.rid, owner, Phase.PREFILLING)

    # -- messages about running requests -------------------------------------------------
    def _owned(self, owner: bytes, rid: str) -> WorkerRequest | None:
        """The request, if router `owner` started it (another router cannot touch it)."""
        req = self.requests.get(rid)
        return req if req is not None and req.owner == owner else None

    def kv_ready(self, owner: bytes, msg: P.KvReady) -> None:
        req = self._owned(owner, msg.rid)
        if req is None or req.phase is not Phase.RESERVED:
            return  # aborted meanwhile
        assert req.handle is not None
        if req.handle.state is not TransferState.DONE:
            # The sender saw an ACK we never gave for this epoch: never trust those blocks.
            log.warning(
                "%s: request %s: KV not whole at kv_ready; computing it", self.worker_id, req.rid
            )
            self.send(req.owner, P.KvFallback(rid=req.rid))
            self._fall_back(req)
            return
        self.transfer.release(req.rid)  # every write was committed: no grant is left open
        req.phase, req.handle = Phase.LANDED, None
        first = W.entry(msg.first_logprobs) if msg.first_logprobs is not None else None
        prompt = W.prompt_entries(msg.prompt_logprobs) if msg.prompt_logprobs is not None else None
        try:
            out = self.engine.remote_kv_ready(req.rid, msg.first_token, first, prompt)
        except ValueError as e:
            self._end(req, V.ErrorCode.BAD_REQUEST, str(e))
            return
        self.on_output(out)

    def kv_failed(self, owner: bytes, msg: P.KvFailed) -> None:
        req = self._owned(owner, msg.rid)
        if req is not None and req.phase is Phase.RESERVED:
            self._fall_back(req)

    def hidden(self, owner: bytes, msg: P.Hidden) -> None:
        """An edge device's hidden state for a split request's newest token."""
        req = self._owned(owner, msg.rid)
        if req is None or not self.engine.has_request(msg.rid):
            return  # aborted or finished meanwhile
        try:
            row = decode_frame(msg.frame, self.engine.model_config.hidden_size, "hidden")
            if row.shape[0] != 1:
                raise ValueError(f"a hidden message carries one token, not {row.shape[0]}")
            self.engine.supply_hidden(msg.rid, row)
        except ValueError as e:
            self._end(req, V.ErrorCode.BAD_REQUEST, f"request {msg.rid}: {e}")

    def abort(self, owner: bytes, rid: str) -> None:
        self.pulls.cancel(rid, owner)
        req = self._owned(owner, rid)
        if req is not None:
            self._drop(req, self.engine.abort_request)

    def drop_owner(self, owner: bytes) -> None:
        """Router `owner` is gone: its requests end here."""
        self.pulls.drop_owner(owner)
        for req in [r for r in self.requests.values() if r.owner == owner]:
            if req.phase is not Phase.FENCED:
                self._drop(req, self.engine.abort_request)

    # -- engine and transfer events ------------------------------------------------------
    def on_output(self, out: RequestOutput) -> None:
        rid = self.children.get(out.request_id, out.request_id)
        req = self.requests.get(rid)
        if req is None:
            return
        if req.phase is Phase.PREFILLING:
            if out.finished:
                req.prefilled = out
                self.pushes.prefill_finished(req.rid, out.outputs[0].token_ids[0])
            return
        self.send(req.owner, output_message(req, out))
        req.seq += 1
        finished = out.finished
        if req.fanout is not None:
            if not self._fan_out(req, out):
                return
            finished = req.fanout.finished
        if finished:
            self._forget(req)

    def _fan_out(self, req: WorkerRequest, out: RequestOutput) -> bool:
        """Starts the other completions once completion 0 has its first token; False when
        one could not start (the request has then ended with an error)."""
        assert req.fanout is not None
        for index in req.fanout.record(out):
            child = req.fanout.child_id(index)
            try:
                params = req.fanout.child_params(index)
                self.engine.add_request(req.prompt_ids, params, child, req.priority)
            except ValueError as e:
                self._end(req, V.ErrorCode.REQUEST_FAILED, f"request {req.rid}: {e}")
                return False
            self.children[child] = req.rid
        return True

    def _forget(self, req: WorkerRequest) -> None:
        """Every completion of the request finished."""
        del self.requests[req.rid]
        self._end_children(req)

    def _end_children(self, req: WorkerRequest) -> None:
        """Forgets completions 1.. of n, and aborts those the engine still runs."""
        if req.fanout is None:
            return
        for index in range(1, req.fanout.started):
            child = req.fanout.child_id(index)
            if self.children.pop(child, None) is not None:
                self.engine.abort_request(child)

    def on_failure(self, failure: RequestFailure) -> None:
        req = self.requests.get(self.children.get(failure.request_id, failure.request_id))
        if req is not None:
            self._end(req, V.ErrorCode.REQUEST_FAILED, failure.message)

    def _on_push_result(
        self, rid: str, first_token: int, error: TransferError | None, stats: dict[str, Any]
    ) -> None:
        req = self.requests.pop(rid, None)
        if req is None:
            return
        if error is None:
            self.send(req.owner, prefill_done(req, first_token, stats))
        else:
            e = RequestError.of_transfer(error)
            self.send(
                req.owner,
                P.Error(rid=rid, code=e.code, message=e.message, transfer_status=e.transfer_status),
            )

    def tick(self) -> None:
        """Reservations that timed out fall back to computing here; fences that ended free
        their blocks."""
        now = time.monotonic()
        self.pulls.tick(now)
        self.migrations.tick()
        for req in list(self.requests.values()):
            if req.phase is Phase.RESERVED:
                assert req.handle is not None
                if req.handle.state.terminal and req.handle.state is not TransferState.DONE:
                    self._fall_back(req)
            elif req.phase is Phase.FENCED and req.fence_until <= now:
                del self.requests[req.rid]
                assert req.then is not None
                req.then(req.rid)

    # -- transitions ---------------------------------------------------------------------
    def _fall_back(self, req: WorkerRequest) -> None:
        """RESERVED -> FALLBACK: the KV will not come; the engine computes the prompt."""
        self.kv_fallbacks += 1
        req.phase, req.handle = Phase.FALLBACK, None
        wait = self.transfer.release(req.rid)
        if wait > 0:
            # A direct writer may still write into the blocks: compute only after the fence.
            req.phase, req.fence_until = Phase.FENCED, time.monotonic() + wait
            req.then = self._recompute(req)
        else:
            self.engine.remote_kv_failed(req.rid)

    def _recompute(self, req: WorkerRequest) -> Callable[[str], None]:
        def then(rid: str) -> None:
            self.engine.remote_kv_failed(rid)
            req.phase, req.then = Phase.FALLBACK, None
            self.requests[rid] = req

        return then

    def _drop(self, req: WorkerRequest, then: Callable[[str], None]) -> None:
        """Ends `req`: its pushes stop, its reservation is released, and `then(rid)` frees
        its blocks in the engine once no direct writer can write there any more."""
        self.pushes.cancel(req.rid)
        self.migrations.forget(req.rid)
        self._end_children(req)  # they computed their prompts here: no fence holds them
        if req.phase is Phase.FENCED:
            req.then = then  # the fence still holds; then free instead of recomputing
            return
        reserved = req.phase in (Phase.RESERVED, Phase.ARRIVING)
        wait = self.transfer.release(req.rid) if reserved else 0.0
        if wait > 0:
            req.phase, req.fence_until, req.then = Phase.FENCED, time.monotonic() + wait, then
        else:
            del self.requests[req.rid]
            then(req.rid)

    def _end(self, req: WorkerRequest, code: V.ErrorCode, message: str) -> None:
        self.send(req.owner, P.Error(rid=req.rid, code=code, message=message))
        self._drop(req, self.engine.abort_request)

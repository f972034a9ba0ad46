"""A worker's live migrations (control/migration.py has the whole flow), both ways:

    source       MigrateOut ──> COPYING (rounds of full blocks while it decodes on)
                   ──few new full blocks──> PAUSED (the rest pushed, last partial block
                   included) ──ACK──> state sent ──Abort──> freed here
                                                 └─MigrateCancel──> decodes on here
    destination  MigrateIn ──> ARRIVING (blocks reserved, a grant for the source only)
                   ──MigrateResume, KV whole, state valid──> RUNNING (Migrated sent)

Any failure on either side sends MigrateFailed and leaves the request where it was.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from hetero_pd.engine import migration as E
from hetero_pd.engine.block_pool import NoFreeBlocksError
from hetero_pd.engine.llm_engine import LLMEngine
from hetero_pd.serving.control import migration as M
from hetero_pd.serving.control import sampling as W
from hetero_pd.serving.worker.request import Phase, WorkerRequest, check_endpoint
from transfer import RemoteBlocks, TransferEngine, TransferError, TransferHandle, TransferState

log = logging.getLogger("hetero_pd.worker")
Send = Callable[[bytes, object], None]
#: Pre-copy goes on in rounds while more than this many blocks filled up during the last
#: one; then the request pauses and the rest moves. At most MAX_ROUNDS rounds before that.
SMALL_ROUND_BLOCKS = 1
MAX_ROUNDS = 8
#: Phases in which a request decodes here and may leave.
DECODING = (Phase.RUNNING, Phase.LANDED, Phase.FALLBACK)


@dataclass(slots=True)
class _Out:
    owner: bytes
    peer: str
    dest: RemoteBlocks
    preemptions: int
    precopy: bool = True
    sent: int = 0  # the request's first blocks pushed so far
    rounds: int = 0
    nbytes: int = 0
    handle: TransferHandle | None = None
    paused_at: float = 0.0
    state_sent: bool = False


class Migrations:
    def __init__(
        self,
        engine: LLMEngine,
        transfer: TransferEngine,
        send: Send,
        requests: dict[str, WorkerRequest],
        drop: Callable[[WorkerRequest], None],
        timeout_s: float,
    ) -> None:
        self.engine, self.transfer, self.send = engine, transfer, send
        self.requests = requests  # the RequestBook's: a request's phase lives there
        self.drop = drop  # ends a request (its reservation released, its blocks freed)
        self.timeout_s = timeout_s
        self._out: dict[str, _Out] = {}

    @property
    def active(self) -> bool:
        return bool(self._out)

    # -- source --------------------------------------------------------------------------
    def start_out(self, owner: bytes, msg: M.MigrateOut) -> None:
        req = self.requests.get(msg.rid)
        now = E.decoding(self.engine, msg.rid)
        problem = None
        if req is None or req.owner != owner or req.phase not in DECODING or now is None:
            problem = "it is not decoding here"
        elif req.fanout is not None:
            problem = "a request with n > 1 does not migrate"
        elif self.engine.config.start_layer:
            problem = "a split (edge) request does not migrate"
        elif msg.rid in self._out:
            problem = "it is migrating already"
        elif len(msg.dest_blocks.block_ids) < -(-now[1] // self.engine.config.block_size):
            problem = f"{len(msg.dest_blocks.block_ids)} blocks cannot hold its KV"
        if problem is None:
            try:
                check_endpoint(msg.dest_address)
                self.transfer.set_peer_address(msg.dest_worker, msg.dest_address)
            except (ValueError, TransferError) as e:
                problem = str(e)
        if problem is not None or now is None:
            self.send(owner, M.MigrateFailed(rid=msg.rid, message=f"request {msg.rid}: {problem}"))
            return
        self._out[msg.rid] = _Out(
            owner, msg.dest_worker, msg.dest_blocks, preemptions=now[2], precopy=msg.precopy
        )
        self._advance(msg.rid)

    def _advance(self, rid: str) -> None:
        out = self._out[rid]
        if out.handle is not None:
            state = out.handle.state
            if not state.terminal:
                return
            if state is not TransferState.DONE:
                self._fail(rid, f"KV push {state.value}: {out.handle.error}")
                return
            out.nbytes += out.handle.nbytes
            out.handle = None
        if out.paused_at:
            if not out.state_sent:
                self._send_state(rid, out)
            return
        now = E.decoding(self.engine, rid)
        if now is None or now[2] != out.preemptions:
            self._fail(rid, "it finished, or was preempted, while its KV was copied")
            return
        blocks, computed, _ = now
        bs = self.engine.config.block_size
        full = computed // bs
        if out.precopy and full - out.sent > SMALL_ROUND_BLOCKS and out.rounds < MAX_ROUNDS:
            self._push(rid, out, blocks, full, full * bs)
            return
        blocks, computed = E.pause(self.engine, rid)
        out.paused_at = time.monotonic()
        need = -(-computed // bs)
        if need > len(out.dest.block_ids):
            self._fail(rid, f"its {computed} tokens outgrew the {len(out.dest.block_ids)} blocks")
        elif need > out.sent:
            self._push(rid, out, blocks, need, computed)
        else:
            self._send_state(rid, out)

    def _push(self, rid: str, out: _Out, blocks: list[int], upto: int, tokens: int) -> None:
        """Pushes the request's blocks [sent, upto), which hold its first `tokens` tokens."""
        lo = out.sent
        dst = RemoteBlocks(out.dest.request_id, out.dest.epoch, out.dest.block_ids[lo:upto])
        num_tokens = tokens - lo * self.engine.config.block_size
        try:
            out.handle = self.transfer.push_blocks(
                out.peer, blocks[lo:upto], dst, num_tokens=num_tokens
            )
        except TransferError as e:
            self._fail(rid, f"KV push refused: {e}")
            return
        out.sent, out.rounds = upto, out.rounds + 1

    def _send_state(self, rid: str, out: _Out) -> None:
        snap = E.snapshot(self.engine, rid)
        state = M.RequestState(
            output_ids=snap.output_ids,
            generator=snap.generator,
            logprobs=W.positions(snap.logprobs) if snap.logprobs is not None else None,
            cumulative_logprob=snap.cumulative_logprob,
            sent_chars=snap.sent_chars,
            seq=self.requests[rid].seq,
            cached_tokens=snap.cached_tokens,
        )
        paused = time.monotonic() - out.paused_at
        self.send(
            out.owner,
            M.MigrateState(
                rid=rid, state=state, bytes=out.nbytes, rounds=out.rounds, paused_s=paused
            ),
        )
        out.state_sent = True

    def _fail(self, rid: str, message: str) -> None:
        out = self._stop(rid)
        if out is not None:
            log.warning("request %s stays here: %s", rid, message)
            self.send(out.owner, M.MigrateFailed(rid=rid, message=f"request {rid}: {message}"))

    def _stop(self, rid: str) -> _Out | None:
        """Ends the source side of `rid`'s migration; a paused request decodes on."""
        out = self._out.pop(rid, None)
        if out is None:
            return None
        if out.handle is not None and not out.handle.state.terminal:
            out.handle.cancel()
        if out.paused_at:
            E.resume(self.engine, rid)
        return out

    def cancel(self, owner: bytes, rid: str) -> None:
        """MigrateCancel: the router called it off; the request decodes on here."""
        out = self._out.get(rid)
        if out is not None and out.owner == owner:
            self._stop(rid)

    def forget(self, rid: str) -> None:
        """The request ended here (aborted, or moved: the router's Abort after Migrated)."""
        out = self._out.pop(rid, None)
        if out is not None and out.handle is not None and not out.handle.state.terminal:
            out.handle.cancel()

    # -- destination ---------------------------------------------------------------------
    def start_in(self, owner: bytes, msg: M.MigrateIn) -> None:
        if msg.rid in self.requests:
            self._refuse(owner, msg.rid, "its id is in use here")
            return
        try:
            params = msg.params.to_params()
            block_ids = E.reserve(
                self.engine, list(msg.prompt_ids), params, msg.rid, msg.priority, msg.num_tokens
            )
        except (ValueError, TypeError, NoFreeBlocksError) as e:
            self._refuse(owner, msg.rid, str(e))
            return
        try:
            handle = self.transfer.reserve(
                msg.rid, block_ids, timeout_s=self.timeout_s, writer=msg.writer
            )
        except TransferError as e:
            self.engine.abort_request(msg.rid)
            self._refuse(owner, msg.rid, str(e))
            return
        assert handle.blocks is not None
        self.requests[msg.rid] = WorkerRequest(msg.rid, owner, Phase.ARRIVING, handle=handle)
        self.send(owner, M.MigrateReady(rid=msg.rid, blocks=handle.blocks))

    def resume_in(self, owner: bytes, msg: M.MigrateResume) -> None:
        req = self.requests.get(msg.rid)
        if req is None or req.owner != owner or req.phase is not Phase.ARRIVING:
            self._refuse(owner, msg.rid, "no migration of it is arriving here")
            return
        assert req.handle is not None
        if req.handle.state is not TransferState.DONE:
            self._end_in(req, f"its KV is not whole ({req.handle.state.value})")
            return
        s = msg.state
        snap = E.Snapshot(
            output_ids=list(s.output_ids),
            generator=s.generator,
            logprobs=W.entries(s.logprobs) if s.logprobs is not None else None,
            cumulative_logprob=s.cumulative_logprob,
            sent_chars=s.sent_chars,
            cached_tokens=s.cached_tokens,
        )
        try:
            E.adopt(self.engine, msg.rid, snap)
        except ValueError as e:
            self._end_in(req, str(e))
            return
        self.transfer.release(msg.rid)  # every write was committed: no grant is left open
        req.phase, req.handle, req.seq, req.prompt_logprobs_sent = Phase.RUNNING, None, s.seq, True
        self.send(owner, M.Migrated(rid=msg.rid))

    def tick(self) -> None:
        for rid in list(self._out):
            self._advance(rid)
        for req in list(self.requests.values()):
            if req.phase is Phase.ARRIVING:
                assert req.handle is not None
                state = req.handle.state
                if state.terminal and state is not TransferState.DONE:
                    self._end_in(req, f"its reservation ended {state.value}")

    def _end_in(self, req: WorkerRequest, message: str) -> None:
        self._refuse(req.owner, req.rid, message)
        self.drop(req)

    def _refuse(self, owner: bytes, rid: str, message: str) -> None:
        self.send(owner, M.MigrateFailed(rid=rid, message=f"request {rid}: {message}"[:16384]))

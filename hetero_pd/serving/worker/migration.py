"""A worker's live migrations (control/migration.py has the whole flow), both ways:

    source       MigrateOut ──> COPYING (rounds of full blocks while it decodes on)
                   ──few new full blocks──> PAUSED (the rest pushed, last partial block
                   included) ──ACK──> state sent ──Abort──> freed here
                                                 └─MigrateCancel──> decodes on here
    destination  MigrateIn ──> ARRIVING (blocks reserved, a grant for the source only)
                   ──MigrateResume, KV whole, state valid──> RUNNING (Migrated sent)

An n > 1 request moves whole: each completion still running is a part with its own
blocks (a share of the one reservation on the destination) and its own state; all pause
together, and the stream goes on from the destination for every one of them.

Any failure on either side sends MigrateFailed and leaves the request where it was.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hetero_pd.engine import migration as E
from hetero_pd.engine.block_pool import NoFreeBlocksError
from hetero_pd.engine.llm_engine import LLMEngine
from hetero_pd.engine.parallel_sampling import ParentRequest
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
NOT_DECODING = "it is not decoding here"


@dataclass(slots=True)
class _Part:
    """One completion of a leaving request (n > 1 has several): its engine request and
    its share of the destination's blocks."""

    engine_id: str
    index: int
    dest_blocks: tuple[int, ...]
    preemptions: int
    sent: int = 0  # its first blocks pushed so far
    paused: bool = False
    gone: bool = False  # it finished here meanwhile: it does not move


@dataclass(slots=True)
class _Out:
    owner: bytes
    peer: str
    dest: RemoteBlocks
    parts: list[_Part]
    precopy: bool = True
    rounds: int = 0
    nbytes: int = 0
    handles: list[TransferHandle] = field(default_factory=list)
    paused_at: float = 0.0
    state_sent: bool = False

    @property
    def live(self) -> list[_Part]:
        return [p for p in self.parts if not p.gone]


class Migrations:
    def __init__(
        self,
        engine: LLMEngine,
        transfer: TransferEngine,
        send: Send,
        requests: dict[str, WorkerRequest],
        children: dict[str, str],
        drop: Callable[[WorkerRequest], None],
        timeout_s: float,
    ) -> None:
        self.engine, self.transfer, self.send = engine, transfer, send
        self.requests = requests  # the RequestBook's: a request's phase lives there
        self.children = children  # the RequestBook's: engine id of completion 1.. -> rid
        self.drop = drop  # ends a request (its reservation released, its blocks freed)
        self.timeout_s = timeout_s
        self._out: dict[str, _Out] = {}

    @property
    def active(self) -> bool:
        return bool(self._out)

    # -- source --------------------------------------------------------------------------
    def start_out(self, owner: bytes, msg: M.MigrateOut) -> None:
        req = self.requests.get(msg.rid)
        parts: list[_Part] = []
        if req is None or req.owner != owner or req.phase not in DECODING:
            problem: str | None = NOT_DECODING
        elif self.engine.config.start_layer:
            problem = "a split (edge) request does not migrate"
        elif msg.rid in self._out:
            problem = "it is migrating already"
        else:
            problem = self._parts(req, msg, parts)
        if problem is None:
            try:
                check_endpoint(msg.dest_address)
                self.transfer.set_peer_address(msg.dest_worker_id, msg.dest_address)
            except (ValueError, TransferError) as e:
                problem = str(e)
        if problem is not None:
            text = f"request {msg.rid}: {problem}"
            not_here = problem == NOT_DECODING  # finished (or all its completions), or not yet
            self.send(owner, M.MigrateFailed(rid=msg.rid, message=text, not_here=not_here))
            return
        self._out[msg.rid] = _Out(owner, msg.dest_worker_id, msg.dest_blocks, parts, msg.precopy)
        self._advance(msg.rid)

    def _parts(self, req: WorkerRequest, msg: M.MigrateOut, parts: list[_Part]) -> str | None:
        """Fills `parts` with the request's completions still running; else the problem."""
        fanout = req.fanout
        if fanout is not None and fanout.started < fanout.n:
            return "its completions have not all started"
        running = {0: req.rid}
        if fanout is not None:
            running = {i: fanout.child_id(i) for i in range(fanout.n) if not fanout.done(i)}
        missing = sorted(set(running) - set(msg.choices))
        if missing or len(set(msg.choices)) != len(msg.choices):
            return f"the migration's choices {msg.choices} are not its running {sorted(running)}"
        dest = msg.dest_blocks.block_ids
        share = len(dest) // len(msg.choices)
        for c, index in enumerate(msg.choices):
            if index not in running:
                continue  # finished here since the router asked: it does not move
            now = E.decoding(self.engine, running[index])
            if now is None:
                return f"completion {index} is not decoding here"
            if share < -(-now[1] // self.engine.config.block_size):
                return f"{share} blocks cannot hold the KV of completion {index}"
            share_ids = dest[c * share : (c + 1) * share]
            parts.append(_Part(running[index], index, share_ids, preemptions=now[2]))
        return None if parts else NOT_DECODING

    def _finished(self, rid: str, index: int) -> bool:
        req = self.requests.get(rid)
        return req is not None and req.fanout is not None and req.fanout.done(index)

    def _advance(self, rid: str) -> None:
        out = self._out[rid]
        if any(not h.state.terminal for h in out.handles):
            return
        for h in out.handles:
            if h.state is not TransferState.DONE:
                self._fail(rid, f"KV push {h.state.value}: {h.error}")
                return
            out.nbytes += h.nbytes
        out.handles = []
        if out.paused_at:
            if not out.state_sent:
                self._send_state(rid, out)
            return
        bs = self.engine.config.block_size
        now: dict[str, tuple[list[int], int, int]] = {}
        for part in out.live:
            state = E.decoding(self.engine, part.engine_id)
            if state is not None and state[2] == part.preemptions:
                now[part.engine_id] = state
            elif self._finished(rid, part.index):
                part.gone = True  # one of n ended here: the others move on
            else:  # it decodes again after a preemption, or it is over: look again
                self._fail(rid, "it finished, or was preempted, while its KV was copied", True)
                return
        live = out.live
        if not live:
            self._fail(rid, "it finished while its KV was copied", True)
            return
        new = sum(now[p.engine_id][1] // bs - p.sent for p in live)
        # Blocks the destination still has room for beyond what each part holds now. After
        # the first round `new` is what decoding filled during the last one, about what the
        # next will fill: it pauses while the rest still fits rather than push past the
        # reservation (a small model on a fast CPU outgrew the router's headroom that way).
        room = min(len(p.dest_blocks) - -(-now[p.engine_id][1] // bs) for p in live)
        if (
            out.precopy
            and new > SMALL_ROUND_BLOCKS * len(live)
            and out.rounds < MAX_ROUNDS
            and room > (new if out.rounds else 0)
        ):
            for part in live:
                blocks, computed, _ = now[part.engine_id]
                full = computed // bs
                if full > part.sent and not self._push(rid, out, part, blocks, full, full * bs):
                    return
            out.rounds += 1
            return
        out.paused_at = time.monotonic()
        paused = []
        for part in live:
            paused.append(E.pause(self.engine, part.engine_id))
            part.paused = True
        for part, (blocks, computed) in zip(live, paused, strict=True):
            need = -(-computed // bs)
            if need > len(part.dest_blocks):
                self._fail(rid, f"its {computed} tokens outgrew {len(part.dest_blocks)} blocks")
                return
            if need > part.sent and not self._push(rid, out, part, blocks, need, computed):
                return
        if out.handles:
            out.rounds += 1
        else:
            self._send_state(rid, out)

    def _push(
        self, rid: str, out: _Out, part: _Part, blocks: list[int], upto: int, tokens: int
    ) -> bool:
        """Pushes `part`'s blocks [sent, upto), which hold its first `tokens` tokens; False
        when the push was refused (the migration then failed)."""
        lo = part.sent
        dst = RemoteBlocks(out.dest.request_id, out.dest.epoch, part.dest_blocks[lo:upto])
        num_tokens = tokens - lo * self.engine.config.block_size
        try:
            handle = self.transfer.push_blocks(
                out.peer, blocks[lo:upto], dst, num_tokens=num_tokens
            )
        except TransferError as e:
            self._fail(rid, f"KV push refused: {e}")
            return False
        out.handles.append(handle)
        part.sent = upto
        return True

    def _send_state(self, rid: str, out: _Out) -> None:
        seq = self.requests[rid].seq
        states = []
        for part in out.live:
            snap = E.snapshot(self.engine, part.engine_id)
            states.append(
                M.RequestState(
                    index=part.index,
                    output_ids=snap.output_ids,
                    generator=snap.generator,
                    logprobs=W.positions(snap.logprobs) if snap.logprobs is not None else None,
                    cumulative_logprob=snap.cumulative_logprob,
                    sent_chars=snap.sent_chars,
                    seq=seq,
                    cached_tokens=snap.cached_tokens,
                )
            )
        paused = time.monotonic() - out.paused_at
        self.send(
            out.owner,
            M.MigrateState(
                rid=rid, states=states, bytes=out.nbytes, rounds=out.rounds, paused_s=paused
            ),
        )
        out.state_sent = True

    def _fail(self, rid: str, message: str, not_here: bool = False) -> None:
        """Ends `rid`'s migration here; `not_here`: it stopped decoding meanwhile (finished or
        preempted), which the router's drain looks at again rather than counts as failed."""
        out = self._stop(rid)
        if out is not None:
            log.warning("request %s stays here: %s", rid, message)
            text = f"request {rid}: {message}"
            self.send(out.owner, M.MigrateFailed(rid=rid, message=text, not_here=not_here))

    def _stop(self, rid: str) -> _Out | None:
        """Ends the source side of `rid`'s migration; a paused request decodes on."""
        out = self._out.pop(rid, None)
        if out is None:
            return None
        self._cancel(out)
        for part in out.parts:
            if part.paused:
                E.resume(self.engine, part.engine_id)
        return out

    @staticmethod
    def _cancel(out: _Out) -> None:
        for handle in out.handles:
            if not handle.state.terminal:
                handle.cancel()

    def cancel(self, owner: bytes, rid: str) -> None:
        """MigrateCancel: the router called it off; the request decodes on here."""
        out = self._out.get(rid)
        if out is not None and out.owner == owner:
            self._stop(rid)

    def forget(self, rid: str) -> None:
        """The request ended here (aborted, or moved: the router's Abort after Migrated)."""
        out = self._out.pop(rid, None)
        if out is not None:
            self._cancel(out)

    # -- destination ---------------------------------------------------------------------
    def start_in(self, owner: bytes, msg: M.MigrateIn) -> None:
        if msg.rid in self.requests:
            self._refuse(owner, msg.rid, "its id is in use here")
            return
        taken: list[str] = []  # engine requests reserved so far
        try:
            params = msg.params.to_params()
            fanout = ParentRequest.arriving(msg.rid, params) if params.n > 1 else None
            if len(set(msg.choices)) != len(msg.choices) or max(msg.choices) >= params.n:
                raise ValueError(f"choices {msg.choices} for n={params.n}")
            block_ids: list[int] = []
            for index in msg.choices:
                engine_id = fanout.child_id(index) if fanout is not None else msg.rid
                child = fanout.child_params(index) if fanout is not None else params
                prompt = list(msg.prompt_ids)
                block_ids += E.reserve(
                    self.engine, prompt, child, engine_id, msg.priority, msg.num_tokens
                )
                taken.append(engine_id)
            handle = self.transfer.reserve(
                msg.rid, block_ids, timeout_s=self.timeout_s, writer=msg.writer
            )
        except (ValueError, TypeError, NoFreeBlocksError, TransferError) as e:
            for engine_id in taken:
                self.engine.abort_request(engine_id)
            self._refuse(owner, msg.rid, str(e))
            return
        assert handle.blocks is not None
        req = WorkerRequest(msg.rid, owner, Phase.ARRIVING, handle=handle, fanout=fanout)
        if fanout is not None:
            req.prompt_ids, req.priority = list(msg.prompt_ids), msg.priority
            for index in range(fanout.n):
                if index not in msg.choices:
                    fanout.end(index)  # it finished on the source before the migration
            self.children.update((e, msg.rid) for e in taken if e != msg.rid)
        self.requests[msg.rid] = req
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
        fanout = req.fanout
        states = {s.index: s for s in msg.states}
        expected = {0} if fanout is None else {i for i in range(fanout.n) if not fanout.done(i)}
        if len(states) != len(msg.states) or not set(states) <= expected:
            self._end_in(req, f"states for completions {sorted(states)}, not {sorted(expected)}")
            return
        try:
            for index, s in states.items():
                engine_id = fanout.child_id(index) if fanout is not None else msg.rid
                E.adopt(self.engine, engine_id, _snapshot(s))
        except ValueError as e:
            self._end_in(req, str(e))
            return
        if fanout is not None:
            for index in expected - set(states):  # finished on the source while it copied
                fanout.end(index)
                engine_id = fanout.child_id(index)
                self.children.pop(engine_id, None)
                self.engine.abort_request(engine_id)
        self.transfer.release(msg.rid)  # every write was committed: no grant is left open
        seq = msg.states[0].seq
        req.phase, req.handle, req.seq, req.prompt_logprobs_sent = Phase.RUNNING, None, seq, True
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


def _snapshot(s: M.RequestState) -> E.Snapshot:
    return E.Snapshot(
        output_ids=list(s.output_ids),
        generator=s.generator,
        logprobs=W.entries(s.logprobs) if s.logprobs is not None else None,
        cumulative_logprob=s.cumulative_logprob,
        sent_chars=s.sent_chars,
        cached_tokens=s.cached_tokens,
    )

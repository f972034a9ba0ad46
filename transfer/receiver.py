"""Receiving side: validates transfers into reserved blocks, verifies, applies, ACKs.

Nothing from the network is written anywhere before it passed, in order: frame validation
(:mod:`transfer.wire`), the session check, the reservation/epoch check (:mod:`transfer.ledger`),
shape and size checks, and the chunk's checksum. A transfer id is applied at most once:
after its commit, repeats are answered with ``ACK(dup=True)`` and nothing is written.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from transfer import checksum, layout, transports, wire
from transfer.errors import StatusCode, TransferError
from transfer.handle import TransferHandle, TransferState
from transfer.hashing import tensor_digest
from transfer.ledger import Reservation
from transfer.region import KVRegion, parse_dtype
from transfer.session import Session

if TYPE_CHECKING:
    from transfer.core import Core


@dataclass(slots=True, eq=False)
class InTransfer:
    """State of one incoming transfer."""

    xid: str
    session: Session
    res: Reservation
    region: KVRegion
    dst_ids: torch.Tensor
    dst_np: np.ndarray
    src_dtype: torch.dtype
    src_shape: tuple[int, ...]
    src_block_bytes: int
    tensors: range
    layers: range
    nsrc: int
    ntok: int
    nf: int
    bpc: int
    algo: str | None
    mode: str
    fingerprint: tuple[str, int]
    good: bytearray
    #: ``layout.is_run(dst_ids)``: chunks land with one slice copy each.
    dst_run: bool
    bad_checksum: set[int] = field(default_factory=set)
    last_seen: float = field(default_factory=time.monotonic)
    started: float = field(default_factory=time.monotonic)
    nbytes: int = 0


@dataclass(slots=True, eq=False)
class PendingPull:
    """A pull we asked a peer to serve; resent until the data commits or the deadline."""

    handle: TransferHandle
    fields: dict[str, Any]
    deadline: float
    resend_at: float


class Receiver:
    """All incoming transfers and pending pulls of one engine (I/O thread only)."""

    def __init__(self, core: Core) -> None:
        self.core = core
        self.active: dict[str, InTransfer] = {}
        self.pulls: dict[str, PendingPull] = {}
        self._next_tick = 0.0

    def _reply_error(self, session: Session, xid: str, err: TransferError) -> None:
        if err.code is StatusCode.STALE_EPOCH:
            self.core.metrics.of("tcp").stale_epoch_rejections_total += 1
        elif err.code is StatusCode.NOT_GRANTED:
            self.core.metrics.reject("not_granted")
        header = wire.encode("error", session.token, x=xid, code=err.code.number, msg=err.message)
        self.core.send(session, "error", header)

    def _ack(
        self,
        session: Session,
        xid: str,
        code: StatusCode = StatusCode.SUCCESS,
        msg: str = "",
        bad: list[int] | None = None,
        dup: bool = False,
    ) -> None:
        header = wire.encode(
            "ack", session.token, x=xid, code=code.number, msg=msg, bad=bad or [], dup=dup
        )
        self.core.send(session, "ack", header)

    # ---- begin --------------------------------------------------------------------------
    def on_begin(self, session: Session, h: dict[str, Any]) -> None:
        """Validate a new transfer against our reservation; grant direct writers a window."""
        xid, fp = h["x"], (h["rid"], h["ep"])
        seen = self.core.ledger.committed.get(xid)
        if seen is not None:
            self.core.metrics.of(
                h["mode"] if h["mode"] in transports.DIRECT else "tcp"
            ).duplicates_total += 1
            if seen == fp:
                self._ack(session, xid, dup=True)
            else:
                self._reply_error(
                    session,
                    xid,
                    TransferError(
                        StatusCode.REPEAT_REQUEST,
                        f"transfer id {xid!r} was used for another request",
                    ),
                )
            return
        it = self.active.get(xid)
        try:
            if it is not None and it.session.peer_id != session.peer_id:
                raise TransferError(
                    StatusCode.NOT_GRANTED, f"transfer id {xid!r} belongs to another peer"
                )
            if it is not None and it.fingerprint != fp:
                raise TransferError(StatusCode.REPEAT_REQUEST, f"transfer id {xid!r} is in use")
            if it is None:
                it = self._validate(session, h)
                self.active[xid] = it
        except TransferError as err:
            self._reply_error(session, xid, err)
            return
        it.session, it.last_seen = session, time.monotonic()  # a retry may come on a new link
        if it.mode in transports.DIRECT:
            # an absolute deadline on our monotonic clock (direct writers share this host):
            # a grant that reaches the writer late is worth only what is left of it
            ttl = self.core.config.grant_s
            until = time.monotonic() + ttl
            self.core.ledger.grant(xid, it.region.name, it.dst_np.tolist(), until)
            header = wire.encode("grant", session.token, x=xid, ttl=ttl, until=until)
            self.core.send(session, "grant", header)

    def _validate(self, session: Session, h: dict[str, Any]) -> InTransfer:
        core = self.core
        region = core.regions.get(h["reg"])
        if region is None:
            raise TransferError(StatusCode.KV_CACHE_NOT_EXIST, f"no region {h['reg']!r} here")
        try:
            dst = wire.int_list(h["dst"], "dst")
            shape = tuple(wire.int_list(h["shape"], "shape"))
            lay = wire.int_list(h["lay"], "lay")
        except wire.FrameError as exc:
            raise TransferError(StatusCode.PARAM_INVALID, str(exc)) from None
        region.check_blocks(dst, "destination")
        if len(lay) != 2:
            raise TransferError(StatusCode.PARAM_INVALID, f"layer range {lay!r}")
        tensors = region.tensor_range((lay[0], lay[1]))
        src_dtype = parse_dtype(h["dt"])
        bs, nsrc, ntok, nf, bpc = h["bs"], h["nsrc"], h["ntok"], h["nf"], h["bpc"]
        problems = []
        if h["tpl"] != region.tensors_per_layer:
            problems.append(f"tensors per layer {h['tpl']} != {region.tensors_per_layer}")
        if (
            len(shape) != len(region.block_shape)
            or shape[0] != bs
            or shape[1:] != region.block_shape[1:]
        ):
            problems.append(f"block shape {shape} incompatible with {region.block_shape}")
        if not 0 < ntok <= nsrc * bs or bpc < 1:
            problems.append(f"{ntok} tokens in {nsrc} blocks of {bs}")
        elif bs == region.block_size and len(dst) != nsrc:
            problems.append(f"{nsrc} source blocks for {len(dst)} destination blocks")
        elif bs != region.block_size and len(dst) < math.ceil(ntok / region.block_size):
            problems.append(f"{len(dst)} destination blocks cannot hold {ntok} tokens")
        if bpc >= 1 and nf != len(tensors) * math.ceil(nsrc / bpc):
            problems.append(f"frame count {nf}")
        block_bytes = math.prod(shape) * torch.empty((), dtype=src_dtype).element_size()
        if bpc * block_bytes > core.config.max_frame_bytes and h["mode"] == "tcp":
            problems.append(f"chunks of {bpc * block_bytes} bytes exceed max_frame_bytes")
        if h["ck"] is not None and h["ck"] not in checksum.available():
            problems.append(f"checksum {h['ck']!r} not installed here")
        mode = h["mode"]
        if mode not in ("tcp", "shm", "local"):
            problems.append(f"transport {mode!r} not accepted")
        elif mode != "tcp" and session.host != core.host:
            problems.append("direct transport from another host")
        elif mode == "shm" and region.shm_token is None:
            problems.append(f"region {region.name!r} is not in shared memory")
        elif mode == "local" and session.pid != core.pid:
            problems.append("local transport from another process")
        if problems:
            raise TransferError(StatusCode.PARAM_INVALID, "; ".join(problems))
        dst_np = np.asarray(dst, dtype=np.int64)
        res = core.ledger.check(region.name, h["rid"], h["ep"], dst_np, writer=session.peer_id)
        return InTransfer(
            h["x"],
            session,
            res,
            region,
            torch.from_numpy(dst_np),
            dst_np,
            src_dtype,
            shape,
            block_bytes,
            tensors,
            range(lay[0], lay[1]),
            nsrc,
            ntok,
            nf,
            bpc,
            h["ck"],
            mode,
            (h["rid"], h["ep"]),
            bytearray(nf),
            bool(dst_np.size <= 1 or (np.diff(dst_np) == 1).all()),
        )

    # ---- data and end -------------------------------------------------------------------
    def on_data(self, session: Session, h: dict[str, Any], payload: memoryview) -> None:
        """Verify and apply one chunk of a stream transfer."""
        xid = h["x"]
        it = self.owned(session, xid)
        if it is None:
            return
        s, ti, lo, hi = h["s"], h["ti"], h["lo"], h["hi"]
        if it.mode != "tcp" or not (
            0 <= s < it.nf and ti in it.tensors and 0 <= lo < hi <= it.nsrc and hi - lo <= it.bpc
        ):
            raise wire.FrameError("bad_field", "data location")
        if len(payload) != (hi - lo) * it.src_block_bytes:
            raise wire.FrameError("bad_size", f"{len(payload)} bytes for {hi - lo} blocks")
        it.last_seen = time.monotonic()
        tm = self.core.metrics.of("tcp")
        if it.good[s]:
            tm.duplicates_total += 1
            return
        if it.algo is not None and (h["d"] is None or checksum.digest(it.algo, payload) != h["d"]):
            tm.checksum_failures_total += 1
            it.bad_checksum.add(s)
            return
        chunk = layout.from_bytes(payload, it.src_dtype, (hi - lo, *it.src_shape))
        # the lock spans check and write: release() cannot free the blocks in between
        with self.core.ledger.lock:
            try:
                self.core.ledger.check(it.region.name, *it.fingerprint, it.dst_np)
            except TransferError as err:
                self._drop(it)
                self._reply_error(session, xid, err)
                return
            layout.scatter(
                it.region.tensors[ti], it.dst_ids, chunk, lo, it.src_shape[0], it.ntok, it.dst_run
            )
        it.good[s] = 1
        it.bad_checksum.discard(s)
        it.nbytes += len(payload)
        tm.bytes_received_total += len(payload)

    def owned(self, session: Session, xid: str) -> InTransfer | None:
        """The incoming transfer ``xid`` if ``session``'s peer is the one sending it."""
        it = self.active.get(xid)
        if it is not None and it.session.peer_id == session.peer_id:
            return it
        if it is not None:
            self.core.metrics.reject("not_granted")
        elif xid in self.core.ledger.committed:
            self.core.metrics.of("tcp").duplicates_total += 1
        else:
            self.core.metrics.reject("unknown_transfer")
        return None

    def landed(self, it: InTransfer, s: int, data: memoryview, digest: int | None) -> None:
        """Chunk ``s`` was read straight into its destination blocks: verify it there."""
        tm = self.core.metrics.of("tcp")
        if it.algo is not None and (digest is None or checksum.digest(it.algo, data) != digest):
            tm.checksum_failures_total += 1
            it.good[s] = 0  # the blocks hold these bytes now, whatever came before
            it.bad_checksum.add(s)
            return
        it.good[s] = 1
        it.bad_checksum.discard(s)
        it.nbytes += len(data)
        tm.bytes_received_total += len(data)

    def reject_stale(self, it: InTransfer, err: TransferError) -> None:
        """The reservation behind ``it`` is gone: forget the transfer, tell the sender."""
        self._drop(it)
        self._reply_error(it.session, it.xid, err)

    def on_end(self, session: Session, h: dict[str, Any]) -> None:
        """All chunks sent: verify completeness (and direct-write digests), then commit."""
        xid = h["x"]
        it = self.active.get(xid)
        if it is not None and it.session.peer_id != session.peer_id:
            self._reply_error(
                session, xid, TransferError(StatusCode.NOT_GRANTED, f"{xid!r} is not yours")
            )
            return
        if it is None:
            seen = self.core.ledger.committed.get(xid)
            if seen is not None:
                self._ack(session, xid, dup=True)
            else:
                self._reply_error(
                    session,
                    xid,
                    TransferError(
                        StatusCode.INCOMPLETE, f"unknown transfer {xid!r}: send begin again"
                    ),
                )
            return
        tm = self.core.metrics.of(it.mode)
        if it.mode in transports.DIRECT:
            self.core.ledger.end_grant(xid)
            bad = self._check_direct(it, h["ds"])
            if bad:
                tm.checksum_failures_total += 1
                self._ack(session, xid, StatusCode.CHECKSUM_MISMATCH, "direct write mismatch", bad)
                return
        else:
            missing = [s for s in range(it.nf) if not it.good[s]]
            if missing:
                code = StatusCode.CHECKSUM_MISMATCH if it.bad_checksum else StatusCode.INCOMPLETE
                self._ack(
                    session, xid, code, f"{len(missing)} of {it.nf} chunks missing or bad", missing
                )
                return
        with self.core.ledger.lock:
            try:
                self.core.ledger.check(it.region.name, *it.fingerprint, it.dst_np)
            except TransferError as err:
                self._drop(it)
                self._reply_error(session, xid, err)
                return
            del self.active[xid]
            complete = self.core.ledger.commit(xid, it.fingerprint, it.res, it.layers)
        if it.mode in transports.DIRECT:
            it.nbytes = it.nsrc * it.src_block_bytes * len(it.tensors)
            tm.bytes_received_total += it.nbytes
        tm.transfers_received_total += 1
        tm.observe(it.nbytes, time.monotonic() - it.started)
        self._ack(session, xid)
        if complete:
            self.core.finish(it.res.handle, TransferState.DONE)
        pull = self.pulls.pop(xid, None)
        if pull is not None:
            self.core.finish(pull.handle, TransferState.DONE)

    def _check_direct(self, it: InTransfer, digests: list[Any] | None) -> list[int]:
        """Chunks whose destination bytes do not match the writer's digests."""
        if it.algo is None:
            return []
        chunks = layout.plan(it.tensors, it.nsrc, it.bpc)
        if digests is None or len(digests) != len(chunks):
            return [c.seq for c in chunks]
        bad = []
        for c, expected in zip(chunks, digests, strict=True):
            image = layout.landed_image(
                it.region.tensors[c.ti],
                it.dst_ids,
                c.lo,
                c.hi - c.lo,
                it.src_shape[0],
                it.ntok,
                it.dst_run,
            )
            if tensor_digest(it.algo, image) != expected:
                bad.append(c.seq)
        return bad

    def _drop(self, it: InTransfer) -> None:
        self.active.pop(it.xid, None)
        self.core.ledger.end_grant(it.xid)

    # ---- pulls, errors, timers ----------------------------------------------------------
    def start_pull(self, session: Session, pull: PendingPull) -> None:
        """Send a pull request and wait for the peer's push to commit."""
        self.pulls[pull.handle.transfer_id] = pull
        pull.handle.state = TransferState.IN_FLIGHT
        self.core.send(session, "pull", wire.encode("pull", session.token, **pull.fields))

    def on_error(self, h: dict[str, Any]) -> bool:
        """An ERROR about one of our pulls; True if it was one."""
        pull = self.pulls.get(h["x"])
        if pull is None:
            return False
        code = StatusCode.from_number(h["code"])
        if not code.recoverable:
            del self.pulls[h["x"]]
            self.core.finish(pull.handle, TransferState.FAILED, TransferError(code, h["msg"]))
        return True

    def release(self, res: Reservation) -> None:
        """Forget transfers into a released reservation (their frames become stale)."""
        for it in [it for it in self.active.values() if it.res is res]:
            self._drop(it)

    def tick(self, now: float) -> None:
        """Deadlines: reservations, pulls, abandoned incoming transfers."""
        if now < self._next_tick:
            return
        self._next_tick = now + 0.01
        core = self.core
        for res in list(core.ledger.by_request.values()):
            if res.alive and not res.handle.done() and now > res.deadline:
                core.ledger.kill(res)
                core.finish(
                    res.handle,
                    TransferState.TIMED_OUT,
                    TransferError(
                        StatusCode.TIMEOUT,
                        f"request {res.blocks.request_id!r}: KV not received in "
                        "time; its blocks now refuse late writes, release() them",
                    ),
                )
        for xid, pull in list(self.pulls.items()):
            if now > pull.deadline:
                del self.pulls[xid]
                core.finish(
                    pull.handle,
                    TransferState.TIMED_OUT,
                    TransferError(StatusCode.TIMEOUT, f"pull {xid!r} not served in time"),
                )
            elif now > pull.resend_at:
                pull.resend_at = now + core.config.ack_timeout_s
                session = core.session_for(pull.handle.peer)
                if session is not None:
                    header = wire.encode("pull", session.token, **pull.fields)
                    self.core.send(session, "pull", header)
        for it in list(self.active.values()):
            if now - it.last_seen > core.config.transfer_timeout_s:
                self._drop(it)

    def abort_all(self, err: TransferError) -> None:
        """Engine shutdown."""
        for pull in self.pulls.values():
            self.core.finish(pull.handle, TransferState.FAILED, err)
        self.pulls.clear()
        for res in list(self.core.ledger.by_request.values()):
            self.core.finish(res.handle, TransferState.FAILED, err)

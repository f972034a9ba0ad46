"""Moving decoding requests between decode workers while they stream (live migration), and
what it is for: `drain` empties a worker so it can stop, restart or switch roles without
ending a request or recomputing one.

The router drives each migration (control/migration.py draws the messages): it reserves
on the destination, has the source copy the KV and send the request's state, hands that
to the destination, and switches the request's stream when the destination's `Migrated`
comes, in the request's own inbox, after the source's last output and before the
destination's first: the client's stream goes on with no gap and no repeat (`Output.seq`
keeps counting). A failure at any step before that leaves the request on the source.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from hetero_pd.serving.control import migration as M
from hetero_pd.serving.control import protocol as P
from hetero_pd.serving.control import sampling as W
from hetero_pd.serving.router.inbox import Inbox, get_within
from hetero_pd.serving.router.metrics import ServingMetrics
from hetero_pd.serving.router.worker_client import WorkerClient, WorkerGone, WorkerUnreachable

log = logging.getLogger("hetero_pd.router")
#: Room the destination reserves beyond the request's tokens when asked: it keeps
#: decoding on the source while the KV is copied.
HEADROOM_TOKENS = 64
#: Migrations a drain runs at once.
DRAIN_CONCURRENCY = 8


@dataclass(slots=True)
class Stream:
    """A request the router streams from its decode worker."""

    rid: str
    decode: WorkerClient
    prompt_ids: list[int]
    params: W.WireParams
    priority: int
    involved: list[WorkerClient]
    migratable: bool
    #: Its completions (of n) without a finish reason yet: those that move with it.
    running: set[int] = field(default_factory=lambda: {0})
    tokens: int = 0  # completion tokens so far, of its longest completion (its outputs said)
    decoding: bool = False  # it had an output: its prompt is done
    dest: WorkerClient | None = None  # the worker it migrates to, while it does
    stage: str = ""  # of its migration: reserving, copying, handing over ("" when none)
    handing_over: bool = False  # the source sent its state and paused it

    def switch(self, worker_id: str) -> bool:
        """The destination says it decodes the request now: its outputs are the stream."""
        if self.dest is None or self.dest.worker_id != worker_id:
            return False
        self.decode, self.dest, self.handing_over, self.stage = self.dest, None, False, ""
        return True


@dataclass(frozen=True, slots=True)
class Migration:
    """How one migration went (`ok` False: the request stayed on `source`)."""

    rid: str
    source: str
    dest: str
    ok: bool
    reason: str = ""
    pause_s: float = 0.0  # the request paused: the last push plus the hand-over
    total_s: float = 0.0
    bytes: int = 0
    rounds: int = 0
    tokens: int = 0  # the request's tokens (prompt and generated) when it moved
    #: The source did not decode it when asked (it had finished, or its KV was still
    #: arriving): nothing moved, and nothing failed.
    not_here: bool = False


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a migration step got no answer it wanted (`not_here`: see Migration)."""

    text: str
    not_here: bool = False

    def __str__(self) -> str:
        return self.text


@dataclass(slots=True)
class Migrator:
    """The router's migrations: `streams` are its requests, `live` its decode workers."""

    streams: dict[str, Stream]
    workers: dict[str, WorkerClient]
    metrics: ServingMetrics
    live: Callable[[], list[WorkerClient]]
    timeout_s: float = 30.0
    inboxes: dict[str, Inbox] = field(default_factory=dict)
    draining: set[str] = field(default_factory=set)

    def deliver(self, worker_id: str, msg: Any) -> None:
        """A migration message (or a worker's death) for the migration of its request."""
        if isinstance(msg, WorkerGone):
            for each in self.inboxes.values():
                each.put_nowait((worker_id, msg))
            return
        inbox = self.inboxes.get(msg.rid)
        if inbox is not None:
            inbox.put_nowait((worker_id, msg))

    def destination(self, source: WorkerClient, dest_id: str | None) -> WorkerClient:
        ok = [
            w
            for w in self.live()
            if w is not source
            and w.worker_id not in self.draining
            and w.info.block_size == source.info.block_size
            and w.info.model == source.info.model
            and not w.start_layer
        ]
        if dest_id is not None:
            ok = [w for w in ok if w.worker_id == dest_id]
        if not ok:
            where = dest_id or "any other decode worker"
            raise ValueError(f"no live decode worker to move to ({where} is not one)")
        return max(ok, key=lambda w: (w.load.free_blocks, -w.load.running))

    async def migrate(
        self, rid: str, dest_id: str | None = None, precopy: bool = True, reason: str = "admin"
    ) -> Migration:
        """Moves request `rid` to `dest_id` (None: the decode worker with the most free
        blocks); `precopy` False pauses it for the whole copy (for comparison); `reason`
        (one of MIGRATION_REASONS: admin, drain, rebalance) labels its metric. Raises
        ValueError when it cannot start (unknown or not decoding yet, an edge request, no
        destination); returns how it went otherwise. An n > 1 request moves whole."""
        stream = self.streams.get(rid)
        if stream is None or not stream.decoding:
            raise ValueError(f"request {rid} is not decoding on this router")
        if not stream.migratable:
            raise ValueError(f"request {rid} does not migrate (an edge request)")
        if stream.dest is not None or rid in self.inboxes:
            raise ValueError(f"request {rid} is migrating already")
        source = stream.decode
        dest = self.destination(source, dest_id)
        self.metrics.migration("started", reason=reason)
        inbox: Inbox = asyncio.Queue()
        self.inboxes[rid] = inbox
        stream.dest = dest
        # It takes the stall allowance it has left along (policy.Chooser.stall_until).
        end = source.inflight.get(rid)
        left = 0 if end is None else end - source.prompt_tokens_given
        dest.inflight[rid] = dest.prompt_tokens_given + left
        if dest not in stream.involved:
            stream.involved.append(dest)
        started = time.monotonic()
        try:
            result = await self._run(stream, source, dest, inbox, started, precopy)
        except WorkerUnreachable as e:
            result = Migration(rid, source.worker_id, dest.worker_id, False, str(e))
        finally:
            self.inboxes.pop(rid, None)
        if result.ok:
            source.inflight.pop(rid, None)
            self.metrics.migration("completed", result.pause_s, result.bytes)
        else:
            if stream.dest is dest:
                stream.dest, stream.handing_over, stream.stage = None, False, ""
            dest.inflight.pop(rid, None)
            dest.try_send(P.Abort(rid=rid))
            source.try_send(M.MigrateCancel(rid=rid))
            self.metrics.migration("aborted")
            if not result.not_here:
                log.warning("request %s stays on %s: %s", rid, source.worker_id, result.reason)
        return result

    async def _run(
        self,
        stream: Stream,
        source: WorkerClient,
        dest: WorkerClient,
        inbox: Inbox,
        started: float,
        precopy: bool,
    ) -> Migration:
        rid = stream.rid
        tokens = len(stream.prompt_ids) + stream.tokens
        choices = sorted(stream.running)
        room = min(tokens + HEADROOM_TOKENS, dest.info.max_model_len - 1)

        def failed(reason: str, not_here: bool = False) -> Migration:
            return Migration(
                rid,
                source.worker_id,
                dest.worker_id,
                False,
                reason,
                total_s=elapsed(),
                not_here=not_here,
            )

        def elapsed() -> float:
            return time.monotonic() - started

        stream.stage = "reserving"
        dest.send(
            M.MigrateIn(
                rid=rid,
                prompt_ids=stream.prompt_ids,
                params=stream.params,
                priority=stream.priority,
                writer=source.worker_id,
                num_tokens=room,
                choices=choices,
            )
        )
        reply = await self._answer(inbox, {dest.worker_id}, (M.MigrateReady,))
        if not isinstance(reply, M.MigrateReady):
            return failed(f"{dest.worker_id}: {reply}")
        stream.stage = "copying"
        source.send(
            M.MigrateOut(
                rid=rid,
                dest_worker_id=dest.worker_id,
                dest_address=dest.info.transfer_address,
                dest_blocks=reply.blocks,
                precopy=precopy,
                choices=choices,
            )
        )
        state = await self._answer(inbox, {source.worker_id, dest.worker_id}, (M.MigrateState,))
        if not isinstance(state, M.MigrateState):
            return failed(f"copy: {state}", isinstance(state, Refusal) and state.not_here)
        handed = time.monotonic()
        stream.handing_over, stream.stage = True, "handing over"
        dest.send(M.MigrateResume(rid=rid, states=state.states))
        done = await self._answer(inbox, {dest.worker_id}, (M.Migrated,))
        if not isinstance(done, M.Migrated):
            return failed(f"hand-over: {done}")
        pause = state.paused_s + (time.monotonic() - handed)
        source.try_send(P.Abort(rid=rid))  # frees the paused request there
        moved = len(stream.prompt_ids) + max(len(s.output_ids) for s in state.states)
        return Migration(
            rid,
            source.worker_id,
            dest.worker_id,
            True,
            "",
            pause,
            elapsed(),
            state.bytes,
            state.rounds,
            moved,
        )

    async def _answer(self, inbox: Inbox, workers: set[str], wanted: tuple[type, ...]) -> Any:
        """The first of `wanted` from one of `workers`; else what went wrong, as text."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                worker_id, msg = await get_within(inbox, max(deadline - time.monotonic(), 0.001))
            except TimeoutError:
                return f"no answer in {self.timeout_s}s"
            if worker_id not in workers:
                continue
            if isinstance(msg, wanted):
                return msg
            if isinstance(msg, WorkerGone):
                return f"worker {worker_id} died"
            if isinstance(msg, M.MigrateFailed):
                return Refusal(f"{worker_id} refused: {msg.message}", msg.not_here)

    async def drain(self, worker_id: str, timeout_s: float = 300.0) -> list[Migration]:
        """Moves every request decoding on `worker_id` to other workers and keeps new ones
        off it (until `undrain`); returns the migrations, the failed ones retried until
        `timeout_s`. Requests still being handed to it are moved once they decode; those
        that cannot move are waited for."""
        self.draining.add(worker_id)
        return await self.evacuate(worker_id, timeout_s, "drain")

    async def evacuate(
        self, worker_id: str, timeout_s: float = 300.0, reason: str = "drain"
    ) -> list[Migration]:
        """`drain`'s moves, for a worker already kept out of rotation (by `drain`, or by
        itself: a worker told to stop, SIGTERM, reports draining); ends early when the
        worker is gone, and waits while no other decode worker could take a request."""
        deadline = time.monotonic() + timeout_s
        done: list[Migration] = []
        limit = asyncio.Semaphore(DRAIN_CONCURRENCY)

        async def move(rid: str) -> Migration | None:
            async with limit:
                try:
                    result = await self.migrate(rid, reason=reason)
                    # finished there meanwhile, or not decoding yet: looked at again next turn
                    return None if result.not_here else result
                except ValueError as e:
                    if rid in self.streams and self.streams[rid].decode.worker_id == worker_id:
                        log.warning("drain %s: %s", worker_id, e)
                    return None

        while time.monotonic() < deadline:
            left = self.on_worker(worker_id)
            source = self.workers.get(worker_id)
            if not left or source is None or source.gone:
                break
            try:
                self.destination(source, None)
            except ValueError:  # every decode worker stops (the deployment does): wait
                await asyncio.sleep(0.5)
                continue
            # A request that cannot move (edge) finishes where it is: only waited for.
            ready = [
                rid
                for rid in left
                if rid in self.streams
                and self.streams[rid].decoding
                and self.streams[rid].migratable
                and self.streams[rid].dest is None
            ]
            results = await asyncio.gather(*(move(rid) for rid in ready))
            done += [r for r in results if r is not None]
            if not any(r is not None and r.ok for r in results):
                await asyncio.sleep(0.05)  # only prompts still arriving, or refusals
        return done

    def undrain(self, worker_id: str) -> None:
        self.draining.discard(worker_id)

    def on_worker(self, worker_id: str) -> list[str]:
        """Requests on `worker_id`: streaming from it, or on their way to it."""
        worker = self.workers.get(worker_id)
        streaming = [rid for rid, s in self.streams.items() if s.decode.worker_id == worker_id]
        arriving = [r for r in worker.inflight if r not in self.streams] if worker else []
        return streaming + arriving


def summary(results: Iterable[Migration]) -> dict[str, Any]:
    """Counts and pauses of migrations, for a drain's answer."""
    results = list(results)
    ok = [r for r in results if r.ok]
    return {
        "moved": len(ok),
        "failed": len(results) - len(ok),
        "max_pause_ms": round(max((r.pause_s for r in ok), default=0.0) * 1e3, 3),
        "bytes": sum(r.bytes for r in ok),
    }

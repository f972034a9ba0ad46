"""Rebalancing (opt-in, as Llumnix does): when a decode worker's KV usage is above `high`
while another's is below `low`, the router live-migrates a few decoding requests from the
first to the second, so the loaded one stops preempting and its batch shrinks.

Each round (every `interval_s`) pairs the most loaded worker above `high` with the least
loaded below `low` (same model and block size, neither draining, neither a split worker),
and moves at most `max_moves` of the loaded one's requests, those with the fewest tokens
first (the least KV to copy, Llumnix's default), skipping those that cannot move (edge
requests, already migrating) or that are about to finish. Both workers then sit out
`cooldown_s`: their heartbeats must first report the KV usage after the moves, or the next
round would act on numbers from before them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from hetero_pd.serving.router.migration import Migration, Migrator, Stream
from hetero_pd.serving.router.worker_client import WorkerClient

log = logging.getLogger("hetero_pd.router")
#: A request with fewer tokens than this left to generate finishes where it is: moving it
#: would cost more than it frees.
MIN_TOKENS_LEFT = 16


@dataclass(frozen=True, slots=True)
class RebalanceConfig:
    """`router.rebalance` (a deployment's RebalanceSpec checks the values)."""

    enabled: bool = False
    high: float = 0.85  # KV usage above which a decode worker sheds requests
    low: float = 0.5  # KV usage below which one takes them
    interval_s: float = 1.0
    max_moves: int = 2  # per round
    cooldown_s: float = 3.0  # a pair that moved requests sits out this long


@dataclass(slots=True)
class Rebalancer:
    cfg: RebalanceConfig
    migrator: Migrator
    live: Callable[[], list[WorkerClient]]
    rounds: int = 0  # rounds that found a worker above high and one below low
    skipped: int = 0  # of those, rounds that moved nothing because rebalancing is off
    moved: int = 0  # requests it moved
    _cooling: dict[str, float] = field(default_factory=dict)  # worker id -> until

    async def run(self) -> None:
        """Rounds every `interval_s` until cancelled."""
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            try:
                await self.round()
            except Exception:  # a round's failure must not end rebalancing
                log.exception("rebalancing round failed")

    def pair(self) -> tuple[WorkerClient, WorkerClient] | None:
        """(loaded, light): the most loaded decode worker above `high` and the least loaded
        one below `low` it can move requests to, neither cooling down; None when none."""
        now = time.monotonic()
        ready = [
            w
            for w in self.live()
            if w.worker_id not in self.migrator.draining
            and not w.start_layer
            and self._cooling.get(w.worker_id, 0.0) <= now
        ]
        loaded = [w for w in ready if w.load.kv_usage > self.cfg.high]
        for source in sorted(loaded, key=lambda w: -w.load.kv_usage):
            light = [
                w
                for w in ready
                if w is not source
                and w.load.kv_usage < self.cfg.low
                and w.info.block_size == source.info.block_size
                and w.info.model == source.info.model
            ]
            if light:
                return source, min(light, key=lambda w: (w.load.kv_usage, w.load.running))
        return None

    def candidates(self, source: WorkerClient) -> list[Stream]:
        """`source`'s requests that may move, those with the fewest tokens first."""
        ok = [
            s
            for s in self.migrator.streams.values()
            if s.decode is source
            and s.decoding
            and s.migratable
            and s.dest is None
            and s.rid not in self.migrator.inboxes
            and _tokens_left(s) >= MIN_TOKENS_LEFT
        ]
        return sorted(ok, key=lambda s: len(s.prompt_ids) + s.tokens)[: self.cfg.max_moves]

    async def round(self) -> list[Migration]:
        """One round: finds a pair and, when enabled, moves requests; returns the moves."""
        found = self.pair()
        if found is None:
            return []
        self.rounds += 1
        if not self.cfg.enabled:
            self.skipped += 1
            return []
        source, dest = found
        streams = self.candidates(source)
        if not streams:
            return []
        log.info(
            "rebalancing: %s (KV %.0f%%) -> %s (KV %.0f%%), %d request(s)",
            source.worker_id, 100 * source.load.kv_usage, dest.worker_id, 100 * dest.load.kv_usage,
            len(streams),
        )  # fmt: skip
        until = time.monotonic() + self.cfg.cooldown_s
        self._cooling[source.worker_id] = self._cooling[dest.worker_id] = until
        results = await asyncio.gather(*(self._move(s.rid, dest.worker_id) for s in streams))
        done = [r for r in results if r is not None]
        self.moved += sum(r.ok for r in done)
        return done

    async def _move(self, rid: str, dest_id: str) -> Migration | None:
        try:
            return await self.migrator.migrate(rid, dest_id, reason="rebalance")
        except ValueError as e:  # it finished, or started moving, meanwhile
            log.info("rebalancing: %s stays: %s", rid, e)
            return None


def _tokens_left(stream: Stream) -> int:
    max_tokens = stream.params.max_tokens
    return MIN_TOKENS_LEFT if max_tokens is None else max_tokens - stream.tokens

"""The router's approximate view of which prefix blocks each worker's KV cache holds.

Workers report the chained hashes of their device prefix cache (`Heartbeat.cached`, at most
`MAX_REPORTED_BLOCKS`, hashed exactly as the router hashes prompts: `prompt_block_hashes`),
and the router adds the prompts it routes to a worker until a report can include them::

    worker heartbeat --CachedBlocks(version, hashes)--> HeldBlocks.report  (replaces the set)
    router routes a prompt to the worker ------------> HeldBlocks.record  (kept record_ttl_s)
    a request's prompt hashes -----------------------> HeldBlocks.matched (leading blocks held)

Approximate both ways: a block may be evicted after the report (the worker then computes
it: a hash hit is always confirmed by token ids on the worker), and one computed since may
be missing. Bounded: a report's hashes, plus at most `record_capacity` recorded ones.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from hetero_pd.serving.control import values as V

#: How long a routed prompt counts as held before a report must confirm it.
RECORD_TTL_S = 5.0


class HeldBlocks:
    """One worker's prefix-cache blocks as the router knows them."""

    def __init__(
        self, record_ttl_s: float = RECORD_TTL_S, record_capacity: int = V.MAX_REPORTED_BLOCKS
    ) -> None:
        self.record_ttl_s = record_ttl_s
        self.record_capacity = record_capacity
        self.version = -1
        self._reported: frozenset[int] = frozenset()
        self._recorded: OrderedDict[int, float] = OrderedDict()  # hash -> expiry

    @property
    def reported(self) -> frozenset[int]:
        """The hashes of the worker's last report."""
        return self._reported

    def __len__(self) -> int:
        return len(self._reported) + len(self._recorded)

    def report(self, cached: V.CachedBlocks) -> None:
        """The worker's own list (validated by the codec: bounded, 64-bit hashes)."""
        self.version = cached.version
        self._reported = frozenset(cached.hashes)

    def record(self, hashes: list[int], now: float | None = None) -> None:
        """The worker was sent these blocks' prompt: count them held for a while."""
        expiry = (time.monotonic() if now is None else now) + self.record_ttl_s
        for h in hashes:
            self._recorded[h] = expiry
            self._recorded.move_to_end(h)
        while len(self._recorded) > self.record_capacity:
            self._recorded.popitem(last=False)

    def clear(self) -> None:
        """The worker restarted or left: it holds nothing we know of."""
        self.version = -1
        self._reported = frozenset()
        self._recorded.clear()

    def matched(self, hashes: list[int], now: float | None = None) -> int:
        """How many of the prompt's first blocks (`hashes`, chained) the worker holds."""
        now = time.monotonic() if now is None else now
        n = 0
        for h in hashes:
            if h not in self._reported and self._recorded.get(h, 0.0) < now:
                break
            n += 1
        return n

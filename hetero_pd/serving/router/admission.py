"""Admission: how many completions may be in flight, in all and per API key.

A request holds one slot per completion it asks for (its prompts times ``n``): that is what
costs the workers, so one request with 256 prompts and ``n = 128`` cannot pass as one. A
client over its key's share, or any client while the server is full, gets a 429 with
``Retry-After``; the slots come back when its answer ends, however it ends. An embeddings
request holds one slot per input, at most :attr:`Admission.largest` (a batch of 2,048 inputs
runs alone for its key rather than being refused).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hetero_pd.serving.router.errors import RouterError

#: Seconds a client told to come back later waits (``Retry-After``).
RETRY_AFTER_S = 1.0


@dataclass(slots=True)
class Slots:
    """Completions admitted for one request; ``release()`` gives them back (once)."""

    admission: Admission
    key: str
    count: int
    released: bool = False

    def release(self) -> None:
        if not self.released:
            self.released = True
            self.admission.give_back(self.key, self.count)


@dataclass(slots=True)
class Admission:
    """Counts completions in flight: at most ``max_inflight`` in all and ``max_per_key`` for
    one API key (``""`` when the deployment has none)."""

    max_inflight: int
    max_per_key: int
    by_key: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        """Completions in flight, all keys together (a key holds one entry at most)."""
        return sum(self.by_key.values())

    @property
    def largest(self) -> int:
        """The most completions one request can ever be admitted with."""
        return min(self.max_inflight, self.max_per_key)

    def admit(self, key: str, count: int) -> Slots:
        """Slots for ``count`` completions under ``key``, or a 429 RouterError."""
        held = self.by_key.get(key, 0)
        if held + count > self.max_per_key:
            raise RouterError(
                429,
                f"this API key has {held} completions in flight and may have at most "
                f"{self.max_per_key}; this request asks for {count}: retry when some finish",
                "key_over_share",
                RETRY_AFTER_S,
            )
        if self.total + count > self.max_inflight:
            raise RouterError(
                429, "the server is at capacity; retry shortly", "overloaded", RETRY_AFTER_S
            )
        self.by_key[key] = held + count
        return Slots(self, key, count)

    def give_back(self, key: str, count: int) -> None:
        left = self.by_key[key] - count
        if left:
            self.by_key[key] = left
        else:
            del self.by_key[key]

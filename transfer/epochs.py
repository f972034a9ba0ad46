"""Epochs: numbers that name one reservation or one offer, never reused, hard to guess.

An epoch is ``counter << 31 | random31``: the counter makes it unique for the engine's
life, the random part means a peer cannot name a live reservation or offer by counting,
so a :class:`~transfer.handle.RemoteBlocks` handed through the control plane also works
as a capability (on top of the writer / reader grant the owner checks).
"""

from __future__ import annotations

import itertools
import secrets
import threading

RANDOM_BITS = 31


class EpochSource:
    """Thread-safe source of fresh epochs (always > 0)."""

    def __init__(self) -> None:
        self._counter = itertools.count(1)
        self._lock = threading.Lock()

    def next(self) -> int:
        """A new epoch, larger than every epoch handed out before."""
        with self._lock:
            count = next(self._counter)
        return (count << RANDOM_BITS) | secrets.randbits(RANDOM_BITS)

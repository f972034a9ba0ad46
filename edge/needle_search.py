"""Multi-needle byte search: which of many needles occur in a large buffer, and where first.

Needles are keyed by their first `min(len, KEY_BYTES)` bytes and grouped by that key length;
for each key length every window of the buffer is hashed at once with a polynomial prefix
hash (uint64 arithmetic, wrapping), so the cost is a few vectorized passes, not one scan per
needle. Every hit is confirmed by comparing the whole needle, so the answer is exact.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import numpy as np

_BASE = 0x9E3779B97F4A7C15  # odd, so it has an inverse modulo 2**64
_BASE_INV = pow(_BASE, -1, 1 << 64)

KEY_BYTES = 8
UInt64Array = np.ndarray[Any, np.dtype[np.uint64]]


def _powers(base: int, count: int) -> UInt64Array:
    """[1, base, base**2, ...] modulo 2**64."""
    p = np.full(count, base, dtype=np.uint64)
    p[0] = 1
    return np.cumprod(p, dtype=np.uint64)


def _hash(needle: bytes, powers: UInt64Array) -> int:
    values = np.frombuffer(needle, np.uint8).astype(np.uint64)
    return int(np.sum(values * powers[: len(needle)], dtype=np.uint64))


def find_all(data: bytes, needles: Iterable[bytes]) -> dict[bytes, int]:
    """Offset of the first occurrence of each needle found in `data` (absent ones omitted)."""
    by_length: dict[int, list[bytes]] = defaultdict(list)
    for needle in set(needles):
        if 0 < len(needle) <= len(data):
            by_length[min(len(needle), KEY_BYTES)].append(needle)
    if not by_length:
        return {}
    n = len(data)
    powers = _powers(_BASE, n + 1)
    inverse = _powers(_BASE_INV, n + 1)
    values = np.frombuffer(data, np.uint8).astype(np.uint64)
    # prefix[i] = sum(data[j] * BASE**j for j < i); window i..i+L hashes to
    # (prefix[i+L] - prefix[i]) * BASE**-i, the same as hashing the needle from 0.
    prefix = np.zeros(n + 1, dtype=np.uint64)
    np.cumsum(values * powers[:n], dtype=np.uint64, out=prefix[1:])
    found: dict[bytes, int] = {}
    for length, group in by_length.items():
        wanted: dict[int, list[bytes]] = defaultdict(list)
        for needle in group:
            wanted[_hash(needle[:length], powers)].append(needle)
        windows = (prefix[length:] - prefix[:-length]) * inverse[: n - length + 1]
        keys = np.sort(np.fromiter(wanted, dtype=np.uint64, count=len(wanted)))
        # Membership by binary search in the keys; np.isin would sort every window.
        slot = np.minimum(np.searchsorted(keys, windows), len(keys) - 1)
        for at in np.nonzero(keys[slot] == windows)[0].tolist():
            pending = wanted.get(int(windows[at]))
            if not pending:
                continue  # every needle with this key is found already
            for needle in [x for x in pending if data.startswith(x, at)]:
                found[needle] = at
                pending.remove(needle)
    return found

"""Replays within a session: each direction numbers what it sends, the receiver takes each
number once.

A MAC (:mod:`transfer.wire`) or an AEAD tag (:mod:`transfer.aead`) says who made a frame,
not when: without numbers, a frame captured on the path and sent again in its session
passed (a replayed RENEW kept a lease alive, a replayed PULL pushed again). So the headers a
session MACs carry ``n`` (1, 2, ... per direction: :meth:`transfer.session.Session.header`)
and sealed chunks their nonce (a counter per direction's key), and the receiver keeps a
:class:`Window` of each::

    top: the highest number taken    seen: a bitmap of the WINDOW numbers below it
    n > top            taken, the window slides up
    top-WINDOW < n <= top, not seen    taken (frames overtake each other: the link and
                                       the data channel, delays, resends)
    seen, or at or below top-WINDOW    refused: "replay" (counted like every rejection)

IPsec's anti-replay window (RFC 4303 §3.4.3). A number is taken only after its frame's MAC
or tag verified, so a forged frame cannot use up numbers; an honest frame that arrives more
than WINDOW numbers late is refused like a lost one and its transfer resends it (a resend
is a new frame: a new number).
"""

from __future__ import annotations

import threading

#: Numbers below the highest taken that may still arrive (overtaken frames).
WINDOW = 4096
_MASK = (1 << WINDOW) - 1


class Window:
    """The numbers one direction of a session took; thread-safe (the link's and the data
    channel's frames may be checked on different threads)."""

    __slots__ = ("_lock", "_seen", "_top")

    def __init__(self) -> None:
        self._top = 0
        self._seen = 0  # bit i: number top - i was taken
        self._lock = threading.Lock()

    def fresh(self, n: int) -> bool:
        """Whether ``n`` could still be taken (a check before the work of verifying)."""
        with self._lock:
            return self._fresh(n)

    def take(self, n: int) -> bool:
        """Takes ``n`` (its frame verified); False when it was taken before or is too old."""
        with self._lock:
            if not self._fresh(n):
                return False
            if n > self._top:
                up = n - self._top
                self._seen = ((self._seen << up) | 1) & _MASK if up < WINDOW else 1
                self._top = n
            else:
                self._seen |= 1 << (self._top - n)
            return True

    def _fresh(self, n: int) -> bool:
        if n < 1:
            return False  # 0: not numbered (only handshake frames, which have no session)
        if n > self._top:
            return True
        behind = self._top - n
        return behind < WINDOW and not (self._seen >> behind) & 1

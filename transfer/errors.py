"""Status codes and the exception raised to callers, modelled on LLM-DataDist's taxonomy.

Every failure a caller can see is a :class:`TransferError` carrying a :class:`StatusCode`.
``code.recoverable`` says whether retrying (possibly after a re-link) can help; the engine
already retries recoverable errors within a transfer's deadline, so a caller that receives
one has run out of time or attempts and should apply its own policy (recompute / retry on
another worker / fail the request).
"""

from __future__ import annotations

import enum


class StatusCode(enum.Enum):
    """Outcome codes. The value is ``(wire number, recoverable)``."""

    SUCCESS = (0, True)
    #: No link to the peer exists (never linked, unlinked, or its session was lost).
    NOT_LINKED = (1, True)
    #: The link handshake failed: peer unreachable, refused, or did not answer in time.
    LINK_FAILED = (2, True)
    #: A deadline passed (LLM-DataDist's WAIT_PROC_TIMEOUT); re-link and retry may help.
    TIMEOUT = (3, True)
    #: The named region, block or reservation does not exist on the peer.
    KV_CACHE_NOT_EXIST = (4, False)
    #: The transfer id was already used for a different transfer.
    REPEAT_REQUEST = (5, False)
    #: Staging or receive memory could not be allocated.
    OUT_OF_MEMORY = (6, True)
    #: A parameter is invalid (shapes, ranges, dtypes, block counts).
    PARAM_INVALID = (7, False)
    #: A block's checksum did not match after the retries allowed.
    CHECKSUM_MISMATCH = (8, True)
    #: The destination blocks were released or re-reserved (epoch changed): write refused.
    STALE_EPOCH = (9, False)
    #: The peer failed authentication.
    AUTH_FAILED = (10, False)
    #: A frame was malformed, oversized or of an unsupported version.
    FRAME_INVALID = (11, True)
    #: Frames of the transfer were lost; the sender resends them.
    INCOMPLETE = (12, True)
    #: The caller cancelled the transfer, or released its reservation.
    CANCELLED = (13, False)
    #: The sender's hold on its source blocks expired before an ACK arrived.
    LEASE_EXPIRED = (14, False)
    #: The engine was closed.
    ENGINE_CLOSED = (15, False)
    #: Unexpected internal failure (a bug): the message says where.
    INTERNAL = (16, False)
    #: The peer holds no grant for this: only a reservation's writer may push into it, and
    #: only an offer's reader may pull it (for that request and epoch, before its lease ends).
    NOT_GRANTED = (17, False)
    #: The source of a pull gave up serving it: its push failed after its own retries (the
    #: text says why). Final for the puller: asking again would start the same push again.
    NOT_SERVED = (18, False)

    @property
    def number(self) -> int:
        """Stable number used on the wire."""
        return self.value[0]

    @property
    def recoverable(self) -> bool:
        """Whether retrying (after a re-link for link errors) can succeed."""
        return self.value[1]

    @classmethod
    def from_number(cls, number: int) -> StatusCode:
        """Decode a wire number; unknown numbers map to INTERNAL."""
        return _BY_NUMBER.get(number, cls.INTERNAL)


_BY_NUMBER = {code.number: code for code in StatusCode}

#: LLM-DataDist's name for a timeout, kept as an alias for readers who know that API.
WAIT_PROC_TIMEOUT = StatusCode.TIMEOUT


class TransferError(Exception):
    """A failed transfer operation: ``code`` says what, the message says what to do."""

    def __init__(self, code: StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message

    @property
    def recoverable(self) -> bool:
        """Shortcut for ``self.code.recoverable``."""
        return self.code.recoverable

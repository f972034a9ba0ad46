"""The router's errors, and how a worker's `Error` becomes one (and an HTTP status)."""

from __future__ import annotations

from hetero_pd.serving.control import protocol as P
from hetero_pd.serving.control import values as V

#: The HTTP status a client gets for each worker error code.
_STATUS = {
    V.ErrorCode.BAD_REQUEST: 400,
    V.ErrorCode.NO_FREE_BLOCKS: 503,
    V.ErrorCode.KV_FENCED: 503,
    V.ErrorCode.DRAINING: 503,
    V.ErrorCode.TRANSFER_FAILED: 503,
    V.ErrorCode.REQUEST_FAILED: 500,
    V.ErrorCode.UNKNOWN_REQUEST: 500,
    V.ErrorCode.OVERLOADED: 503,
    V.ErrorCode.INTERNAL: 500,
}


class RouterError(Exception):
    """A request the router cannot serve; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str, code: str, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.retry_after = status, message, code, retry_after


def worker_error(msg: P.Error) -> RouterError:
    """The HTTP-facing error for a worker's `Error` message."""
    status = _STATUS[msg.code]
    return RouterError(status, msg.message, msg.code.name.lower(), 2.0 if status == 503 else None)

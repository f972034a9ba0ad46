"""Large request bodies decoded in a process of their own, so that the router's GIL is free.

msgspec holds the GIL while it decodes (`bodies`): one 16 MiB body is one C call of 40-60 ms
on a shared 2-core EPYC, longer when the OS preempts the thread holding it, and bodies that
arrive together decode back to back, so the event loop waited their sum (235 ms for four
measured by ``hetero-pd bench hostile``) before it could answer /health, stream a token or
read a heartbeat. A body larger than ``INLINE_BYTES`` is therefore decoded
(`bodies.decode_body`, with every bound it checks) in a child process: the router's process
only hands the bytes to a pipe, written with the GIL released, and takes back the decoded
fields or the 400. Smaller bodies, nearly all of them, are decoded on the tokenizer thread
with the rest of the request's parsing (well under a millisecond), with no round trip.

    request.read() ──> ≤ INLINE_BYTES: raw bytes ───────────> tokenizer thread: decode_body
                   └─> larger: decoder process: decode_body ─> tokenizer thread: the fields

The process starts with the first large body (spawned: it imports `bodies` and msgspec,
not torch, about 0.2 s), decodes one body at a time, and is replaced if it dies: the
bodies it held are decoded once more by its replacement.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from hetero_pd.serving.api.bodies import Body, BodyKind, decode_body
from hetero_pd.serving.api.errors import APIError

log = logging.getLogger("hetero_pd.api")

#: Bodies up to this size are decoded on the tokenizer thread (about 1 ms of msgspec for a
#: body of integers this large); larger ones in the decoder process.
INLINE_BYTES = 256 * 1024


class BodyDecoder:
    """Decodes the bodies larger than ``INLINE_BYTES`` in a child process (one body at a
    time, so a flood of them costs the host one core at most); `close()` stops it."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None

    async def prepare(self, raw: bytes, kind: BodyKind, max_ids: int) -> Body:
        """``raw`` itself when it is small (the tokenizer thread decodes it, `bodies.fields`),
        else its decoded fields; a 400 (`APIError`) when the body is refused."""
        if len(raw) <= INLINE_BYTES:
            return raw
        try:
            return await self._decode(raw, kind, max_ids)
        except BrokenProcessPool:
            pass  # killed (by an operator, or for memory): its replacement tries once more
        try:
            return await self._decode(raw, kind, max_ids)
        except BrokenProcessPool:
            raise APIError(
                503,
                "the process that decodes large request bodies ended twice while decoding "
                "this one; retry, or send a smaller body",
                "server_error",
            ) from None

    async def _decode(self, raw: bytes, kind: BodyKind, max_ids: int) -> dict[str, Any]:
        if self._pool is None:
            # spawn: the router's process runs threads (ZMQ, the tokenizer), which fork would
            # copy into the child mid-operation.
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
        pool = self._pool
        try:
            fields: dict[str, Any] = await asyncio.wrap_future(
                pool.submit(decode_body, raw, kind, max_ids)
            )
        except BrokenProcessPool:
            if self._pool is pool:
                log.error("the process decoding large request bodies ended; starting another")
                self._pool = None
            raise
        return fields

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

"""Request bodies in reading, bounded in all.

Each body may be 16 MiB (`MAX_BODY_BYTES`, the app's `client_max_size`), but a client that
opens connections and sends their bodies slowly, or never ends them, had the router hold every
byte received so far on every connection. Each read first takes its body's announced length
(or the most a body may be, where none is announced) from `ReadBudget.limit`; past it the
request is answered 503 with Retry-After at once, unread, and the share comes back when the
read ends, whether it completed, failed or its client left. What is decoded afterwards is
bounded apart (`body_process.BodyDecoder.max_waiting_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

from aiohttp import web

from hetero_pd.serving.api.errors import APIError

#: The most one body may be: the app's `client_max_size`.
MAX_BODY_BYTES = 16 * 2**20
#: Bytes of bodies in reading at once, in all (sixteen at the largest).
MAX_READING_BYTES = 16 * MAX_BODY_BYTES
RETRY_AFTER_S = 1.0


@dataclass(slots=True)
class ReadBudget:
    limit: int = MAX_READING_BYTES
    #: Bytes taken by the reads under way.
    reading: int = 0

    async def read(self, request: web.Request) -> bytes:
        """The body of `request`, read within the budget (APIError 503 past it)."""
        announced = request.content_length
        share = MAX_BODY_BYTES if announced is None else min(announced, MAX_BODY_BYTES)
        if self.reading + share > self.limit:
            raise APIError(
                503,
                f"{self.reading} bytes of request bodies are being read, and this one's "
                f"{share} would pass the {self.limit} allowed: retry shortly",
                "server_error",
                code="body_reads_full",
                retry_after=RETRY_AFTER_S,
            )
        self.reading += share
        try:
            return await request.read()
        finally:
            self.reading -= share

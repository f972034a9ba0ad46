"""Request bodies in reading, bounded in all.

Each body may be 16 MiB (`MAX_BODY_BYTES`, the app's `client_max_size`), but a client that
opens connections and sends their bodies slowly, or never ends them, had the router hold every
byte received so far on every connection. `ReadBudget` counts the bytes actually received by
the reads under way, against `limit`: a body whose announced length would pass it is refused
before its first byte is read, one that passes it as its bytes come is refused then (503 with
Retry-After either way), and a read's bytes are given back when it ends, whether it completed,
failed or its client left. Only bytes received count, so a connection that announces a body
and sends nothing holds no one else's share. What is decoded afterwards is bounded apart
(`body_process.BodyDecoder.max_waiting_bytes`).
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
        """The body of `request`, read within the budget (APIError 503 past it; 413 past
        MAX_BODY_BYTES, as aiohttp's own read answers)."""
        self._check(request.content_length or 0)
        body = bytearray()
        try:
            async for chunk in request.content.iter_any():
                self._check(len(chunk))
                self.reading += len(chunk)
                body += chunk
                if len(body) > MAX_BODY_BYTES:
                    raise web.HTTPRequestEntityTooLarge(
                        max_size=MAX_BODY_BYTES, actual_size=len(body)
                    )
            return bytes(body)
        finally:
            self.reading -= len(body)

    def _check(self, more: int) -> None:
        if self.reading + more > self.limit:
            raise APIError(
                503,
                f"{self.reading} bytes of request bodies are being read, and this one's "
                f"{more} more would pass the {self.limit} allowed: retry shortly",
                "server_error",
                code="body_reads_full",
                retry_after=RETRY_AFTER_S,
            )

"""The /health prober of ``hetero-pd bench hostile``, in a module of its own: the bench starts
it in a fresh (spawned) process, which imports only this, not the bench's shapes and what
they need (the edge protocol, the transfer package, torch), so the probing starts seconds
sooner."""

from __future__ import annotations

import http.client
import time
from multiprocessing.connection import Connection
from typing import Any
from urllib.parse import urlsplit


def probe(url: str, ready: Any, stop: Any, out: Connection) -> None:
    """GET /health back to back until `stop` is set (`ready` set once the first is
    answered); sends back (start, seconds, status) of each, start on the system-wide
    monotonic clock."""
    parts = urlsplit(url)
    got: list[tuple[float, float, int]] = []
    while not stop.is_set():
        start = time.monotonic()
        conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=60)
        try:
            conn.request("GET", "/health")
            resp = conn.getresponse()
            resp.read()
            status = resp.status
        except OSError:
            status = 0
        finally:
            conn.close()
        got.append((start, time.monotonic() - start, status))
        if status:
            ready.set()
    out.send(got)
    out.close()

"""Link measurements for the split planner: bandwidth and RTT of a TCP link, and a tiny probe
server to measure against (tests use it on loopback; a deployment can run it beside the
router).

Protocol (one TCP connection): the client sends an 8-byte little-endian length and that
many bytes; the server reads them all and answers one byte. A zero-length message measures
the round trip; a large one the upload bandwidth (edge -> cloud is the direction that
carries hidden states).
"""

from __future__ import annotations

import socket
import socketserver
import statistics
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from edge.planner import LinkProfile

_LEN = struct.Struct("<Q")


def measure_link(
    host: str,
    port: int,
    *,
    payload_bytes: int = 1 << 20,
    pings: int = 20,
    bulk: int = 3,
    timeout_s: float = 5.0,
) -> LinkProfile:
    """RTT (median of `pings` empty messages) and upload bandwidth (median of `bulk` sends of
    `payload_bytes`, less one RTT) to a link probe server (see `serve_link_probe`)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _exchange(sock, b"")  # connection warm-up
            rtt = statistics.median(_exchange(sock, b"") for _ in range(pings))
            payload = bytes(payload_bytes)
            seconds = statistics.median(_exchange(sock, payload) for _ in range(bulk))
    except OSError as e:  # ConnectionError and timeouts included
        raise ConnectionError(f"link probe to {host}:{port} failed: {e}") from e
    bandwidth = payload_bytes / max(seconds - rtt, 1e-9)
    return LinkProfile(bandwidth_bps=bandwidth, rtt_s=rtt)


def _exchange(sock: socket.socket, payload: bytes) -> float:
    start = time.perf_counter()
    sock.sendall(_LEN.pack(len(payload)) + payload)
    if sock.recv(1) != b"\x01":
        raise ConnectionError("link probe server closed the connection or answered garbage")
    return time.perf_counter() - start


class _ProbeHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while (header := _recv_exact(sock, _LEN.size)) is not None:
            remaining = _LEN.unpack(header)[0]
            while remaining:
                chunk = sock.recv(min(remaining, 1 << 20))
                if not chunk:
                    return
                remaining -= len(chunk)
            sock.sendall(b"\x01")


def _recv_exact(sock: socket.socket, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


@contextmanager
def serve_link_probe(host: str = "127.0.0.1", port: int = 0) -> Iterator[tuple[str, int]]:
    """Runs a link probe server in a thread; yields its (host, port) (port 0: any free one)."""
    server = _Server((host, port), _ProbeHandler)
    thread = threading.Thread(
        target=server.serve_forever, args=(0.05,), name="link-probe", daemon=True
    )
    thread.start()
    try:
        address = server.server_address
        yield str(address[0]), int(address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)

"""Transfer metrics: plain counters per transport; the engine's typed health and metrics.

The engine's I/O thread is the only writer; :meth:`Metrics.snapshot` copies under a lock into
a frozen :class:`TransferMetrics`, so the serving layer can read it from any thread.
Names follow Prometheus conventions (``_total`` for counters, ``_seconds`` / ``_bytes``
units) so the exporter can map them one to one.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field, replace

#: Upper bounds (seconds) of the transfer latency histogram buckets.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)


@dataclass(slots=True)
class TransportMetrics:
    """Counters of one transport (``local``, ``shm``, ``tcp``, ``cuda_ipc``)."""

    bytes_sent_total: int = 0
    bytes_received_total: int = 0
    #: Writes (sender side): chunks sent as one frame (``tcp``) or copied into the peer's
    #: blocks (direct), each a run of whole blocks of one KV tensor; a resend counts again.
    chunks_sent_total: int = 0
    transfers_started_total: int = 0
    transfers_done_total: int = 0
    transfers_failed_total: int = 0
    transfers_timed_out_total: int = 0
    #: Incoming transfers verified and committed (receiver side).
    transfers_received_total: int = 0
    retries_total: int = 0
    relinks_total: int = 0
    checksum_failures_total: int = 0
    #: Direct writes (receiver side): chunks this engine hashed in its own blocks because
    #: the writer had not verified them as it copied (see ``landed`` in transfer/README.md).
    chunks_read_back_total: int = 0
    lease_expiries_total: int = 0
    duplicates_total: int = 0
    stale_epoch_rejections_total: int = 0
    latency_seconds_sum: float = 0.0
    latency_seconds_count: int = 0
    latency_seconds_max: float = 0.0
    latency_buckets: list[int] = field(default_factory=lambda: [0] * len(LATENCY_BUCKETS))
    #: Throughput of the most recent completed send (bytes / latency), in GB/s.
    last_gbps: float = 0.0

    def observe(self, nbytes: int, seconds: float) -> None:
        """Record one completed transfer."""
        self.latency_seconds_sum += seconds
        self.latency_seconds_count += 1
        self.latency_seconds_max = max(self.latency_seconds_max, seconds)
        for i, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                self.latency_buckets[i] += 1
        if seconds > 0:
            self.last_gbps = nbytes / seconds / 1e9


@dataclass(slots=True)
class Metrics:
    """All metrics of one engine."""

    transports: dict[str, TransportMetrics] = field(default_factory=dict)
    #: Frames rejected before use, by reason (malformed, oversized, unauthenticated, ...).
    frames_rejected: Counter[str] = field(default_factory=Counter)
    links_total: int = 0
    link_failures_total: int = 0
    auth_failures_total: int = 0
    #: Data connections that presented a live session's token.
    data_links_total: int = 0
    #: Peers whose data channel could not be reached, so streams went over the link.
    data_fallbacks_total: int = 0
    faults_injected_total: int = 0
    #: Exceptions (bugs) contained on the I/O thread: each failed one command, timer or frame.
    internal_errors_total: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def of(self, transport: str) -> TransportMetrics:
        """Counters of ``transport`` (created on first use)."""
        counters = self.transports.get(transport)
        if counters is None:
            with self.lock:
                counters = self.transports.setdefault(transport, TransportMetrics())
        return counters

    def reject(self, reason: str) -> None:
        """Count one rejected frame."""
        with self.lock:
            self.frames_rejected[reason] += 1

    def snapshot(
        self,
        engine_id: str,
        *,
        peers: int,
        transfers_active: int,
        held_blocks: int,
        reserved_blocks: int,
    ) -> TransferMetrics:
        """A copy of every counter (each transport's its own), plus the given gauges."""
        with self.lock:
            return TransferMetrics(
                engine_id=engine_id,
                transports={
                    name: replace(c, latency_buckets=list(c.latency_buckets))
                    for name, c in self.transports.items()
                },
                frames_rejected=dict(self.frames_rejected),
                frames_rejected_total=sum(self.frames_rejected.values()),
                links_total=self.links_total,
                link_failures_total=self.link_failures_total,
                auth_failures_total=self.auth_failures_total,
                data_links_total=self.data_links_total,
                data_fallbacks_total=self.data_fallbacks_total,
                faults_injected_total=self.faults_injected_total,
                internal_errors_total=self.internal_errors_total,
                latency_bucket_bounds=LATENCY_BUCKETS,
                peers=peers,
                transfers_active=transfers_active,
                held_blocks=held_blocks,
                reserved_blocks=reserved_blocks,
            )


@dataclass(frozen=True, slots=True)
class TransferMetrics:
    """One engine's metrics at one moment (``TransferEngine.metrics()``): counters, the
    ``frames_rejected`` counts by reason, and gauges. ``transports`` holds copies."""

    engine_id: str
    transports: dict[str, TransportMetrics]
    #: Frames rejected before use, by reason (``unauthenticated``, ``not_granted``, ...).
    frames_rejected: dict[str, int]
    frames_rejected_total: int
    links_total: int
    link_failures_total: int
    auth_failures_total: int
    data_links_total: int
    data_fallbacks_total: int
    faults_injected_total: int
    internal_errors_total: int
    latency_bucket_bounds: tuple[float, ...]
    #: Gauges: peers with a live session, transfers in flight either way, source blocks
    #: held, destination blocks reserved.
    peers: int
    transfers_active: int
    held_blocks: int
    reserved_blocks: int

    def transport(self, name: str) -> TransportMetrics:
        """Counters of transport ``name`` (all zero when it moved nothing yet)."""
        return self.transports.get(name) or TransportMetrics()

    def rejected(self, reason: str) -> int:
        """Frames rejected for ``reason`` so far."""
        return self.frames_rejected.get(reason, 0)


@dataclass(frozen=True, slots=True)
class TransferHealth:
    """``TransferEngine.health()``: a worker whose transfer engine is unhealthy is not."""

    #: The I/O thread runs and the engine is not closing.
    healthy: bool
    closed: bool
    #: Why the I/O thread died, or None.
    error: str | None
    #: Bugs contained on the I/O thread so far (each failed one command, timer or frame).
    internal_errors: int
    #: Done callbacks that raised in progress() (the caller's bugs), contained.
    callback_errors: int = 0

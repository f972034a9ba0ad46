"""Prometheus metrics of the router, exported on GET /metrics.

Each :class:`ServingMetrics` owns its own ``CollectorRegistry`` (never the process-global
one), so tests and several routers in one process do not clash. Every name starts with
``hetero_pd_``; times are in seconds. Label values come from fixed sets (outcomes, policy
decisions) or from the deployment (worker ids, transports, transfer status codes), so the
number of series stays bounded; unknown outcomes or decisions raise ``ValueError``.

prometheus_client is thread-safe: any thread (or the event loop) may call these methods.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

PREFIX = "hetero_pd_"
#: The classic text exposition format, which ``generate_latest`` writes and every Prometheus
#: version scrapes (newer prometheus_client names it version 1.0.0; the body is the same).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: How a request ended: its finish reason ("stop", "length", "abort" for a client
#: disconnect or cancel), "rejected" when refused under overload (429), "error" otherwise.
OUTCOMES = ("stop", "length", "abort", "rejected", "error")
#: What the router's policy decided for a request (or for a failed KV transfer).
DECISIONS = ("disaggregated", "local_prefill", "colocated", "retry", "recompute", "fail")

#: 1 ms .. 120 s, denser where TTFT/TPOT targets usually sit (10 ms .. 2 s).
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0,
)  # fmt: skip
#: 100 us .. 30 s: one KV transfer, from a few blocks over shm to a long prompt over TCP.
TRANSFER_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip


class ServingMetrics:
    """The router's request, worker, KV-transfer and policy metrics."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry

        def hist(name: str, doc: str, buckets: Iterable[float], *labels: str) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, registry=r, buckets=tuple(buckets))

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=r)

        def gauge(name: str, doc: str, *labels: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=r)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
        self.tpot = hist(
            "time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            LATENCY_BUCKETS,
        )
        self.itl = hist("inter_token_latency_seconds", "Time between two tokens.", LATENCY_BUCKETS)
        self.e2e = hist(
            "e2e_request_latency_seconds",
            "Request latency, arrival to last token.",
            LATENCY_BUCKETS,
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.requests = counter("requests", "Requests by how they ended.", "outcome")
        for outcome in OUTCOMES:
            self.requests.labels(outcome)

        labels = ("worker", "role")
        self.queue_depth = gauge("worker_queue_depth", "Requests waiting on a worker.", *labels)
        self.running = gauge("worker_running", "Requests running on a worker.", *labels)
        self.kv_usage = gauge("worker_kv_usage", "Fraction of KV blocks in use (0..1).", *labels)
        self.up = gauge("worker_up", "1 when the worker is alive and serving, else 0.", *labels)
        self.rejected = gauge(
            "worker_control_frames_rejected",
            "Control frames a worker refused so far: failed authentication or not a message.",
            *labels,
        )
        self._roles: dict[str, str] = {}

        self.transfer_bytes = counter("kv_transfer_bytes", "KV bytes moved.", "transport")
        self.transfer_seconds = hist(
            "kv_transfer_seconds", "Duration of one KV transfer.", TRANSFER_BUCKETS, "transport"
        )
        self.transfer_gbps = gauge(
            "kv_transfer_gbps", "Throughput of the last KV transfer, GB/s (1e9 B/s).", "transport"
        )
        self.transfer_failures = counter(
            "kv_transfer_failures", "Failed KV transfers by status code.", "code"
        )
        self.transfer_retries = counter("kv_transfer_retries", "KV transfer retries.")
        self.decisions = counter("policy_decisions", "Routing policy decisions.", "decision")
        for decision in DECISIONS:
            self.decisions.labels(decision)

    def observe_request(
        self,
        ttft: float | None,
        tpot: float | None,
        itl_list: Iterable[float],
        e2e: float | None,
        prompt_tokens: int,
        gen_tokens: int,
        outcome: str,
    ) -> None:
        """Record a finished request; a latency of ``None`` was not measured (no token)."""
        self.count_request(outcome)
        if ttft is not None:
            self.ttft.observe(ttft)
        if tpot is not None:
            self.tpot.observe(tpot)
        for gap in itl_list:
            self.itl.observe(gap)
        if e2e is not None:
            self.e2e.observe(e2e)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(gen_tokens)

    def count_request(self, outcome: str) -> None:
        """Count a request that ended with ``outcome`` without latencies (e.g. rejected)."""
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown request outcome {outcome!r}; expected one of {OUTCOMES}")
        self.requests.labels(outcome).inc()

    def set_worker(
        self,
        worker: str,
        role: str,
        queue_depth: int,
        running: int,
        kv_usage: float,
        up: bool,
        rejected: int = 0,
    ) -> None:
        """Publish a worker's latest load report (replaces its series if its role changed)."""
        old_role = self._roles.get(worker)
        if old_role is not None and old_role != role:
            self.remove_worker(worker)
        self._roles[worker] = role
        self.queue_depth.labels(worker, role).set(queue_depth)
        self.running.labels(worker, role).set(running)
        self.kv_usage.labels(worker, role).set(min(max(kv_usage, 0.0), 1.0))
        self.up.labels(worker, role).set(1 if up else 0)
        self.rejected.labels(worker, role).set(rejected)

    def remove_worker(self, worker: str) -> None:
        """Drop a worker's series (it left the deployment); unknown workers are ignored."""
        role = self._roles.pop(worker, None)
        if role is None:
            return
        for g in (self.queue_depth, self.running, self.kv_usage, self.up, self.rejected):
            g.remove(worker, role)

    def observe_transfer(self, transport: str, nbytes: int, seconds: float) -> None:
        """Record one completed KV transfer of ``nbytes`` over ``transport``."""
        self.transfer_bytes.labels(transport).inc(nbytes)
        self.transfer_seconds.labels(transport).observe(seconds)
        if seconds > 0:
            self.transfer_gbps.labels(transport).set(nbytes / seconds / 1e9)

    def transfer_failure(self, code: str) -> None:
        """Count a KV transfer that failed with status ``code`` (e.g. ``"TIMEOUT"``)."""
        self.transfer_failures.labels(code).inc()

    def transfer_retry(self) -> None:
        """Count one retried KV transfer."""
        self.transfer_retries.inc()

    def decision(self, name: str) -> None:
        """Count one policy decision (one of :data:`DECISIONS`)."""
        if name not in DECISIONS:
            raise ValueError(f"unknown policy decision {name!r}; expected one of {DECISIONS}")
        self.decisions.labels(name).inc()

    def render(self) -> tuple[bytes, str]:
        """The GET /metrics response: body and Content-Type (Prometheus text format)."""
        return generate_latest(self.registry), CONTENT_TYPE

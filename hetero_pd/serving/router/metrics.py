"""Prometheus metrics of the router, exported on GET /metrics.

Each :class:`ServingMetrics` owns its own ``CollectorRegistry`` (never the process-global
one), so tests and several routers in one process do not clash. Our names start with
``hetero_pd_``, are in base units and carry the conventional suffixes (``_seconds``,
``_bytes``, ``_ratio``, ``_total`` on counters); every series has a ``model_name`` label
(the served model name). Beside ours, the few vLLM-named series that dashboards and
gateways (llm-d, the Gateway API inference extension) read are exported for the whole
deployment: ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
``vllm:kv_cache_usage_perc`` (and its older name ``vllm:gpu_cache_usage_perc``: the mean
KV usage of the decode-capable workers, 0..1), ``vllm:time_to_first_token_seconds`` and
``vllm:time_per_output_token_seconds`` (vLLM's buckets), and per speculating worker
vLLM's ``vllm:spec_decode_*`` counters (spec_metrics.py). Label values come from fixed sets
(outcomes, policy decisions) or from the deployment (worker ids, transports, transfer status
codes), so the number of series stays bounded; unknown outcomes or decisions raise
``ValueError``.

prometheus_client is thread-safe: any thread (or the event loop) may call these methods.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from hetero_pd.serving.router.spec_metrics import SpecDecodeMetrics

PREFIX = "hetero_pd_"
VLLM = "vllm:"
#: The classic text exposition format, which ``generate_latest`` writes and every Prometheus
#: version scrapes (newer prometheus_client names it version 1.0.0; the body is the same).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: How a request ended: its finish reason ("stop", "length", "abort" for a client
#: disconnect or cancel), "rejected" when refused under overload (429), "error" otherwise.
OUTCOMES = ("stop", "length", "abort", "rejected", "error")
#: What the router's policy decided for a request (or for a failed KV transfer).
MIGRATION_STAGES = ("started", "completed", "aborted")
#: Why a migration started: an operator's /admin/migrate, a drain (restart, scale-down,
#: role switch), the rebalancing policy, or its worker being told to stop (SIGTERM: a
#: Kubernetes pod's termination) and saying so in its heartbeat.
MIGRATION_REASONS = ("admin", "drain", "rebalance", "shutdown")
DECISIONS = (
    "disaggregated",
    "local_prefill",
    "colocated",
    "retry",
    "recompute",
    "fail",
    "prefix_pull",
)

#: 1 ms .. 120 s, denser where TTFT/TPOT targets usually sit (10 ms .. 2 s).
LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 1.5, 2.0, 2.5, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0,
)  # fmt: skip
#: vLLM's own buckets, so dashboards' quantiles over its series read the same.
VLLM_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
VLLM_TPOT_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
#: 100 us .. 30 s: one KV transfer, from a few blocks over shm to a long prompt over TCP.
TRANSFER_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip


@dataclass(slots=True)
class _WorkerLoad:
    role: str
    queued: int
    running: int
    kv_usage: float
    up: bool


class ServingMetrics:
    """The router's request, worker, KV-transfer and policy metrics."""

    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = "") -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        r = self.registry
        m = ("model_name",)

        def hist(name: str, doc: str, buckets: Iterable[float], *labels: str) -> Histogram:
            return Histogram(name, doc, m + labels, registry=r, buckets=tuple(buckets))

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(PREFIX + name, doc, m + labels, registry=r)

        def gauge(name: str, doc: str, *labels: str) -> Gauge:
            return Gauge(name, doc, m + labels, registry=r)

        def latency(name: str, doc: str) -> Histogram:
            return hist(PREFIX + name, doc, LATENCY_BUCKETS).labels(model_name)

        self.ttft = latency("time_to_first_token_seconds", "Time to first token.")
        self.tpot = latency(
            "time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
        )
        self.itl = latency("inter_token_latency_seconds", "Time between two tokens.")
        self.e2e = latency("e2e_request_latency_seconds", "Request latency, arrival to last token.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.").labels(
            model_name
        )
        self.generation_tokens = counter("generation_tokens", "Generated tokens.").labels(
            model_name
        )
        self.requests = counter("requests", "Requests by how they ended.", "outcome")
        for outcome in OUTCOMES:
            self.requests.labels(model_name, outcome)

        labels = ("worker", "role")
        self.queue_depth = gauge(
            PREFIX + "worker_queue_depth", "Requests waiting on a worker.", *labels
        )
        self.running = gauge(PREFIX + "worker_running", "Requests running on a worker.", *labels)
        self.kv_usage = gauge(
            PREFIX + "worker_kv_usage_ratio", "Fraction of KV blocks in use (0..1).", *labels
        )
        self.up = gauge(
            PREFIX + "worker_up", "1 when the worker is alive and serving, else 0.", *labels
        )
        self.rejected = gauge(
            PREFIX + "worker_control_frames_rejected",
            "Control frames a worker refused so far: failed authentication or not a message.",
            *labels,
        )
        self.transfer_refused = gauge(
            PREFIX + "worker_transfer_auth_failures",
            "Transfer links a worker refused so far: a failed proof, or a peer id it holds "
            "no pair key for.",
            *labels,
        )
        self._workers: dict[str, _WorkerLoad] = {}

        self.transfer_bytes = counter("kv_transfer_bytes", "KV bytes moved.", "transport")
        self.transfer_seconds = hist(
            PREFIX + "kv_transfer_seconds",
            "Duration of one KV transfer.",
            TRANSFER_BUCKETS,
            "transport",
        )
        self.transfer_throughput = gauge(
            PREFIX + "kv_transfer_throughput_bytes_per_second",
            "Throughput of the last KV transfer.",
            "transport",
        )
        self.transfer_failures = counter(
            "kv_transfer_failures", "Failed KV transfers by status code.", "code"
        )
        self.transfer_retries = counter("kv_transfer_retries", "KV transfer retries.").labels(
            model_name
        )
        self.decisions = counter("policy_decisions", "Routing policy decisions.", "decision")
        for decision in DECISIONS:
            self.decisions.labels(model_name, decision)

        self.migrations = counter(
            "migrations", "Live migrations of decoding requests, by stage.", "stage"
        )
        for stage in MIGRATION_STAGES:
            self.migrations.labels(model_name, stage)
        self.migration_reasons = counter(
            "migrations_by_reason", "Live migrations started, by why.", "reason"
        )
        for reason in MIGRATION_REASONS:
            self.migration_reasons.labels(model_name, reason)
        self.migration_pause = hist(
            PREFIX + "migration_pause_seconds",
            "How long a migrated request stopped decoding (the last copy and the hand-over).",
            LATENCY_BUCKETS,
        ).labels(model_name)
        self.migration_bytes = counter("migration_bytes", "KV bytes live migrations moved.").labels(
            model_name
        )

        self.vllm_running = gauge(VLLM + "num_requests_running", "Requests running.")
        self.vllm_waiting = gauge(VLLM + "num_requests_waiting", "Requests waiting.")
        self.vllm_kv_usage = gauge(
            VLLM + "kv_cache_usage_perc", "KV cache usage of the decode workers (0..1)."
        )
        self.vllm_gpu_cache_usage = gauge(
            VLLM + "gpu_cache_usage_perc", "Older name of vllm:kv_cache_usage_perc."
        )
        self.vllm_ttft = hist(
            VLLM + "time_to_first_token_seconds", "Time to first token.", VLLM_TTFT_BUCKETS
        ).labels(model_name)
        self.vllm_tpot = hist(
            VLLM + "time_per_output_token_seconds",
            "Time per output token after the first.",
            VLLM_TPOT_BUCKETS,
        ).labels(model_name)
        self.spec_decode = SpecDecodeMetrics(r, model_name)
        self._publish_totals()

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
            self.vllm_ttft.observe(ttft)
        if tpot is not None:
            self.tpot.observe(tpot)
            self.vllm_tpot.observe(tpot)
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
        self.requests.labels(self.model_name, outcome).inc()

    def set_worker(
        self,
        worker: str,
        role: str,
        queue_depth: int,
        running: int,
        kv_usage: float,
        up: bool,
        rejected: int = 0,
        transfer_refused: int = 0,
    ) -> None:
        """Publish a worker's latest load report (replaces its series if its role changed)."""
        old = self._workers.get(worker)
        if old is not None and old.role != role:
            self.remove_worker(worker)
        kv_usage = min(max(kv_usage, 0.0), 1.0)
        self._workers[worker] = _WorkerLoad(role, queue_depth, running, kv_usage, up)
        key = (self.model_name, worker, role)
        self.queue_depth.labels(*key).set(queue_depth)
        self.running.labels(*key).set(running)
        self.kv_usage.labels(*key).set(kv_usage)
        self.up.labels(*key).set(1 if up else 0)
        self.rejected.labels(*key).set(rejected)
        self.transfer_refused.labels(*key).set(transfer_refused)
        self._publish_totals()

    def remove_worker(self, worker: str) -> None:
        """Drop a worker's series (it left the deployment); unknown workers are ignored."""
        self.spec_decode.remove(worker)
        old = self._workers.pop(worker, None)
        if old is None:
            return
        gauges = (self.queue_depth, self.running, self.kv_usage, self.up, self.rejected)
        for g in (*gauges, self.transfer_refused):
            g.remove(self.model_name, worker, old.role)
        self._publish_totals()

    def _publish_totals(self) -> None:
        """vLLM's deployment-wide series from the live workers' latest reports."""
        live = [w for w in self._workers.values() if w.up]
        decode = [w.kv_usage for w in live if w.role in ("decode", "both")]
        self.vllm_running.labels(self.model_name).set(sum(w.running for w in live))
        self.vllm_waiting.labels(self.model_name).set(sum(w.queued for w in live))
        usage = sum(decode) / len(decode) if decode else 0.0
        self.vllm_kv_usage.labels(self.model_name).set(usage)
        self.vllm_gpu_cache_usage.labels(self.model_name).set(usage)

    def observe_transfer(self, transport: str, nbytes: int, seconds: float) -> None:
        """Record one completed KV transfer of ``nbytes`` over ``transport``."""
        self.transfer_bytes.labels(self.model_name, transport).inc(nbytes)
        self.transfer_seconds.labels(self.model_name, transport).observe(seconds)
        if seconds > 0:
            self.transfer_throughput.labels(self.model_name, transport).set(nbytes / seconds)

    def transfer_failure(self, code: str) -> None:
        """Count a KV transfer that failed with status ``code`` (e.g. ``"TIMEOUT"``)."""
        self.transfer_failures.labels(self.model_name, code).inc()

    def transfer_retry(self) -> None:
        """Count one retried KV transfer."""
        self.transfer_retries.inc()

    def migration(
        self, stage: str, pause_s: float = 0.0, nbytes: int = 0, reason: str = ""
    ) -> None:
        """Count a migration that started (and why), completed (its pause and bytes) or
        aborted."""
        self.migrations.labels(self.model_name, stage).inc()
        if reason:
            if reason not in MIGRATION_REASONS:
                raise ValueError(f"unknown migration reason {reason!r}; one of {MIGRATION_REASONS}")
            self.migration_reasons.labels(self.model_name, reason).inc()
        if stage == "completed":
            self.migration_pause.observe(pause_s)
            self.migration_bytes.inc(nbytes)

    def decision(self, name: str) -> None:
        """Count one policy decision (one of :data:`DECISIONS`)."""
        if name not in DECISIONS:
            raise ValueError(f"unknown policy decision {name!r}; expected one of {DECISIONS}")
        self.decisions.labels(self.model_name, name).inc()

    def render(self) -> tuple[bytes, str]:
        """The GET /metrics response: body and Content-Type (Prometheus text format)."""
        return generate_latest(self.registry), CONTENT_TYPE

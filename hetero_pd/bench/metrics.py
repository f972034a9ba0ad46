"""Per-request measurements and the serving metrics computed from them.

Definitions follow `vllm bench serve`, so numbers from the two tools compare:

- TTFT: send -> first content chunk.  E2E latency: send -> last chunk with choices.
- TPOT: ``(e2e - ttft) / (output_tokens - 1)``, only for requests with more than one
  output token (a one-token request has no decode phase; it is left out of the TPOT
  statistics and meets any TPOT SLO, as in vLLM's goodput).
- ITL: gaps between successive content chunks, pooled over all requests.
- Percentiles: numpy's default linear interpolation.
- Throughputs divide by the whole benchmark duration and count completed requests only;
  input tokens are the server's ``usage.prompt_tokens`` when it sent usage, else the
  dataset's prompt length (vLLM always uses the latter).

SLOs follow DistServe: a request is *good* iff it completed and meets every given SLO
(TTFT <= slo_ttft, TPOT <= slo_tpot, optionally E2E <= slo_e2el).  Attainment is good /
all requests sent (rejected and failed ones included); goodput is good requests per second.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(slots=True)
class RequestResult:
    """What one request measured; durations in seconds, from the moment it was sent."""

    prompt_len: int
    max_tokens: int
    start_time: float = 0.0
    success: bool = False
    status: int | None = None
    error: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None
    generated_text: str = ""

    @property
    def rejected(self) -> bool:
        """The server turned the request away under load (HTTP 429)."""
        return self.status == 429

    @property
    def server_error(self) -> bool:
        """The server answered with a 5xx status."""
        return self.status is not None and 500 <= self.status < 600

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None below two output tokens."""
        if not self.success or self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @property
    def input_tokens(self) -> int:
        """The server's prompt token count when it reported one, else the dataset's."""
        return self.prompt_tokens if self.prompt_tokens is not None else self.prompt_len


@dataclass(frozen=True, slots=True)
class SLO:
    """Latency targets in milliseconds; None means "no target" for that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    @property
    def empty(self) -> bool:
        return self.ttft_ms is None and self.tpot_ms is None and self.e2el_ms is None

    def is_good(self, r: RequestResult) -> bool:
        """DistServe's test: completed and within every given target."""
        if not r.success:
            return False
        tpot = r.tpot or 0.0
        checks = ((self.ttft_ms, r.ttft), (self.tpot_ms, tpot), (self.e2el_ms, r.latency))
        return all(limit is None or value * 1000.0 <= limit for limit, value in checks)

    def to_dict(self) -> dict[str, float | None]:
        return {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms, "e2el_ms": self.e2el_ms}


def parse_slo(items: Sequence[str]) -> SLO:
    """Parse ``["ttft:500", "tpot:100"]`` (or ``"ttft:500,tpot:100"``) into an SLO."""
    values: dict[str, float] = {}
    for item in (part for raw in items for part in raw.split(",") if part):
        name, sep, number = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"--slo: expected ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        try:
            ms = float(number)
        except ValueError:
            raise ValueError(f"--slo: {item!r} needs a number of milliseconds") from None
        if not ms > 0:
            raise ValueError(f"--slo: {item!r} must be a positive number of milliseconds")
        values[f"{name}_ms"] = ms
    return SLO(**values)


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """Summary of one latency metric, in milliseconds."""

    mean: float
    median: float
    std: float
    percentiles: dict[int, float]


def latency_stats(values_s: Sequence[float]) -> LatencyStats | None:
    """Mean, median, std and PERCENTILES of ``values_s`` (seconds) in ms; None if empty."""
    if len(values_s) == 0:
        return None
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    pcts = np.percentile(ms, PERCENTILES)
    return LatencyStats(
        mean=float(ms.mean()),
        median=float(np.median(ms)),
        std=float(ms.std()),
        percentiles={p: float(v) for p, v in zip(PERCENTILES, pcts, strict=True)},
    )


@dataclass(frozen=True, slots=True)
class BenchmarkMetrics:
    """Everything one benchmark run reports; ``to_dict`` gives the JSON keys."""

    duration: float
    num_requests: int
    completed: int
    rejected: int
    server_errors: int
    other_errors: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    good_requests: int | None
    request_goodput: float | None
    slo_attainment: float | None
    latencies: dict[str, LatencyStats | None]

    @property
    def failed(self) -> int:
        return self.rejected + self.server_errors + self.other_errors

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "duration": self.duration,
            "num_requests": self.num_requests,
            "completed": self.completed,
            "failed": self.failed,
            "rejected": self.rejected,
            "server_errors": self.server_errors,
            "other_errors": self.other_errors,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "good_requests": self.good_requests,
            "request_goodput": self.request_goodput,
            "slo_attainment": self.slo_attainment,
        }
        for name in LATENCY_METRICS:
            s = self.latencies[name]
            out[f"mean_{name}_ms"] = s.mean if s else None
            out[f"median_{name}_ms"] = s.median if s else None
            out[f"std_{name}_ms"] = s.std if s else None
            for p in PERCENTILES:
                out[f"p{p}_{name}_ms"] = s.percentiles[p] if s else None
        return out


def latency_samples(results: Sequence[RequestResult]) -> dict[str, list[float]]:
    """Per-metric samples in seconds over completed requests (ITL pooled over chunks)."""
    done = [r for r in results if r.success]
    return {
        "ttft": [r.ttft for r in done],
        "tpot": [t for r in done if (t := r.tpot) is not None],
        "itl": [gap for r in done for gap in r.itl],
        "e2el": [r.latency for r in done],
    }


def compute_metrics(
    results: Sequence[RequestResult], duration: float, slo: SLO | None = None
) -> BenchmarkMetrics:
    """Aggregate ``results`` of a run that took ``duration`` seconds."""
    if duration <= 0:
        raise ValueError(f"benchmark duration must be positive, got {duration}")
    done = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    rejected = sum(r.rejected for r in failed)
    server_errors = sum(r.server_error for r in failed)
    total_in = sum(r.input_tokens for r in done)
    total_out = sum(r.output_tokens for r in done)
    good: int | None = None
    if slo is not None and not slo.empty:
        good = sum(slo.is_good(r) for r in results)
    samples = latency_samples(results)
    return BenchmarkMetrics(
        duration=duration,
        num_requests=len(results),
        completed=len(done),
        rejected=rejected,
        server_errors=server_errors,
        other_errors=len(failed) - rejected - server_errors,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(done) / duration,
        output_throughput=total_out / duration,
        total_token_throughput=(total_in + total_out) / duration,
        good_requests=good,
        request_goodput=None if good is None else good / duration,
        slo_attainment=None if good is None or not results else good / len(results),
        latencies={name: latency_stats(samples[name]) for name in LATENCY_METRICS},
    )

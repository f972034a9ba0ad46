"""Drive one benchmark run: send requests on an arrival schedule, at most C in flight.

Requests are released at their scheduled times (see ``arrivals``) whatever the server
does; with ``max_concurrency`` set, a released request waits for a free slot before it is
sent, and its timings start when it is sent.  The run's duration spans from the first
release to the last response, as in `vllm bench serve`.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import aiohttp
from tqdm import tqdm

from hetero_pd.bench.arrivals import send_offsets
from hetero_pd.bench.client import PATHS, Endpoint, base_url, build_payload, send_request
from hetero_pd.bench.datasets import BenchRequest
from hetero_pd.bench.metrics import RequestResult


@dataclass(frozen=True, slots=True)
class RunConfig:
    """How to send one run's requests."""

    url: str
    model: str
    endpoint: Endpoint = "completions"
    rate: float = float("inf")
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    temperature: float = 0.0
    ignore_eos: bool = False
    extra_body: dict[str, Any] = field(default_factory=dict)
    api_key: str | None = None
    request_timeout: float = 3600.0
    progress: bool = True

    @property
    def endpoint_url(self) -> str:
        return base_url(self.url) + PATHS[self.endpoint]

    def with_rate(self, rate: float) -> RunConfig:
        return replace(self, rate=rate)


@dataclass(frozen=True, slots=True)
class RunOutcome:
    """The per-request results, in request order, and the run's wall time in seconds."""

    results: list[RequestResult]
    duration: float


def _session(cfg: RunConfig) -> aiohttp.ClientSession:
    # limit=0: the connector must never be the hidden cap on concurrency.
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=cfg.request_timeout),
    )


def _headers(cfg: RunConfig) -> dict[str, str] | None:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None


def _payload(cfg: RunConfig, req: BenchRequest) -> dict[str, Any]:
    return build_payload(
        cfg.endpoint, cfg.model, req, cfg.temperature, cfg.ignore_eos, cfg.extra_body
    )


async def send_one(cfg: RunConfig, req: BenchRequest) -> RequestResult:
    """Send a single request outside any run (the pre-flight check)."""
    async with _session(cfg) as session:
        return await send_request(
            session, cfg.endpoint_url, cfg.endpoint, _payload(cfg, req), req, _headers(cfg)
        )


async def run_benchmark(
    requests: Sequence[BenchRequest], cfg: RunConfig, desc: str = "requests"
) -> RunOutcome:
    """Send ``requests`` as ``cfg`` says and wait for every answer."""
    if cfg.max_concurrency is not None and cfg.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {cfg.max_concurrency}")
    offsets = send_offsets(len(requests), cfg.rate, cfg.burstiness, cfg.seed)
    slots = asyncio.Semaphore(cfg.max_concurrency or len(requests) or 1)
    headers = _headers(cfg)
    url = cfg.endpoint_url
    bar = tqdm(total=len(requests), desc=desc, file=sys.stderr, disable=not cfg.progress)

    async def one(session: aiohttp.ClientSession, req: BenchRequest) -> RequestResult:
        payload = _payload(cfg, req)
        async with slots:
            result = await send_request(session, url, cfg.endpoint, payload, req, headers)
        bar.update(1)
        return result

    try:
        async with _session(cfg) as session:
            start = time.perf_counter()
            tasks = []
            for offset, req in zip(offsets, requests, strict=True):
                # Sleeping until the next scheduled send *is* the workload, not a sync hack.
                delay = start + offset - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(session, req)))
            results = await asyncio.gather(*tasks)
            duration = time.perf_counter() - start
    finally:
        bar.close()
    return RunOutcome(list(results), duration)

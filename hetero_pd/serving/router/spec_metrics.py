"""vLLM's speculative decoding counters on GET /metrics, from the workers' heartbeats.

Each speculating worker reports its engine's totals (`SpecDecodeCounts`); they are exported
per worker as counters under vLLM's names (a restarted worker starts again from 0, which
Prometheus reads as a counter reset):

    vllm:spec_decode_num_drafts_total                verified proposal runs
    vllm:spec_decode_num_draft_tokens_total          proposed tokens
    vllm:spec_decode_num_accepted_tokens_total       accepted proposed tokens
    vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}

Mean acceptance length (tokens a verifying step yields per sequence) is
1 + accepted_tokens / drafts; the acceptance rate is accepted_tokens / draft_tokens.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, Metric

from hetero_pd.serving.control.values import SpecDecodeCounts

NAME = "vllm:spec_decode_"


class SpecDecodeMetrics:
    """A Prometheus collector of the latest totals each worker reported."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        self._lock = threading.Lock()
        self._counts: dict[str, SpecDecodeCounts] = {}
        registry.register(self)

    def set(self, worker: str, counts: SpecDecodeCounts | None) -> None:
        with self._lock:
            if counts is None:
                self._counts.pop(worker, None)
            else:
                self._counts[worker] = counts

    def remove(self, worker: str) -> None:
        self.set(worker, None)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counts = dict(self._counts)
        labels = ["model_name", "worker"]
        drafts = CounterMetricFamily(NAME + "num_drafts", "Verified proposal runs.", labels=labels)
        draft_tokens = CounterMetricFamily(
            NAME + "num_draft_tokens", "Proposed tokens verified.", labels=labels
        )
        accepted = CounterMetricFamily(
            NAME + "num_accepted_tokens", "Proposed tokens accepted.", labels=labels
        )
        per_pos = CounterMetricFamily(
            NAME + "num_accepted_tokens_per_pos",
            "Proposed tokens accepted, by position in their run.",
            labels=[*labels, "position"],
        )
        for worker, c in sorted(counts.items()):
            key = [self.model_name, worker]
            drafts.add_metric(key, c.drafts)
            draft_tokens.add_metric(key, c.draft_tokens)
            accepted.add_metric(key, c.accepted_tokens)
            for pos, n in enumerate(c.accepted_per_pos):
                per_pos.add_metric([*key, str(pos)], n)
        yield from (drafts, draft_tokens, accepted, per_pos)

"""Routing policies: which worker prefills, which decodes, and whether to disaggregate."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

from hetero_pd.engine.kv_cache_manager import prompt_block_hashes
from hetero_pd.serving.worker_client import WorkerClient

Policy = Literal["round_robin", "least_loaded", "prefix_aware"]
FailurePolicy = Literal["recompute", "retry", "fail"]
POLICIES = ("round_robin", "least_loaded", "prefix_aware")
FAILURE_POLICIES = ("recompute", "retry", "fail")


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    policy: Policy = "least_loaded"
    # Conditional disaggregation: prefill on the decode worker itself when the prompt part
    # not already cached there is at most this long, ...
    local_prefill_max_tokens: int = 32
    # ... or (elastic) when the prefill workers' backlog is longer than the decode worker's
    # whole job, or the decode worker's batch is empty while the prefill workers are busy
    # (it would only wait for the KV); without it, only when every prefill worker has more
    # than `prefill_queue_limit_tokens` queued.
    elastic_prefill: bool = True
    prefill_queue_limit_tokens: int = 8192
    #: A decode worker with more of its KV cache in use than this takes no prompt itself.
    elastic_kv_limit: float = 0.85
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"router policy must be one of {POLICIES}, got {self.policy!r}")


class Chooser:
    """Picks workers. The prefix-aware policy remembers which worker last served each
    prompt block hash (an approximate radix index, as SGLang's cache-aware router) and
    prefers the worker holding the longest prefix unless it is much busier."""

    def __init__(self, cfg: RoutingConfig, index_capacity: int = 100_000) -> None:
        self.cfg = cfg
        # One round-robin counter per candidate set: picking the decode worker must not
        # advance the prefill rotation (with one decoder and two prefillers, a shared counter
        # would send every prompt to the same prefill worker).
        self._rr: dict[tuple[str, ...], itertools.count[int]] = {}
        self._owner: OrderedDict[int, str] = OrderedDict()
        self._capacity = index_capacity

    def pick(
        self, candidates: list[WorkerClient], prompt_ids: list[int] | None = None
    ) -> tuple[WorkerClient, int]:
        """Returns (worker, number of prompt tokens it likely has cached)."""
        if not candidates:
            raise LookupError("no live worker")
        if self.cfg.policy == "round_robin":
            counter = self._rr.setdefault(tuple(w.id for w in candidates), itertools.count())
            return candidates[next(counter) % len(candidates)], 0
        least = min(candidates, key=lambda w: w.load_score)
        if self.cfg.policy == "least_loaded" or not prompt_ids:
            return least, 0
        best, matched = self._longest_prefix(candidates, prompt_ids)
        if best is not None and best.load_score <= 2 * least.load_score + 512:
            return best, matched
        return least, 0

    def _longest_prefix(
        self, candidates: list[WorkerClient], prompt_ids: list[int]
    ) -> tuple[WorkerClient | None, int]:
        by_id = {w.id: w for w in candidates}
        best: WorkerClient | None = None
        matched = 0
        for i, h in enumerate(prompt_block_hashes(prompt_ids, self.cfg.block_size)):
            owner = by_id.get(self._owner.get(h, ""))
            if owner is None or (best is not None and owner is not best):
                break
            best, matched = owner, (i + 1) * self.cfg.block_size
        return best, matched

    def record(self, worker: WorkerClient, prompt_ids: list[int]) -> None:
        """Notes that `worker` now holds the KV of this prompt's full blocks."""
        if self.cfg.policy != "prefix_aware":
            return
        for h in prompt_block_hashes(prompt_ids, self.cfg.block_size):
            self._owner[h] = worker.id
            self._owner.move_to_end(h)
        while len(self._owner) > self._capacity:
            self._owner.popitem(last=False)

    def prefill_locally(
        self,
        prompt_len: int,
        cached_tokens: int,
        prefill: list[WorkerClient],
        decode: WorkerClient,
    ) -> bool:
        """Conditional disaggregation (after NVIDIA Dynamo), by prompt, queue and load.

        Backlogs are prompt tokens not yet computed: what the router sent and has not seen
        done, or what the worker's last heartbeat reported queued, whichever is larger."""
        if not prefill:
            return True
        uncached = prompt_len - cached_tokens
        if uncached <= self.cfg.local_prefill_max_tokens:
            return True
        prefill_backlog = min(w.backlog_tokens for w in prefill)
        if not self.cfg.elastic_prefill:
            return prefill_backlog > self.cfg.prefill_queue_limit_tokens
        load = decode.load
        if load.kv_usage >= self.cfg.elastic_kv_limit:
            return False
        decode_backlog = decode.backlog_tokens
        empty_batch = load.running == 0 and decode_backlog == 0
        if empty_batch and prefill_backlog > 0:
            return True  # decode would idle until the KV came: it computes the prompt now
        return prefill_backlog >= decode_backlog + uncached

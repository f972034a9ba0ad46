"""Routing policies: which worker prefills, which decodes, and whether to disaggregate.

    round_robin    turns, per candidate set
    least_loaded   the smallest `load_score` (queued prompt tokens, running, in flight)
    prefix_aware   the worker holding the longest prefix of the prompt, unless it is much
                   busier than the least loaded one (SGLang's cache-aware router)
    kv_aware       the smallest cost = kv_overlap_weight x prompt blocks it would compute
                   + blocks of work it already has (NVIDIA Dynamo's KV router cost)

The prefix policies read each worker's `HeldBlocks` (prefix_index.py): its reported prefix
cache plus the prompts recently routed to it, hashed as the engine hashes them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Literal, get_args

from hetero_pd.engine.kv_cache_manager import prompt_block_hashes
from hetero_pd.serving.control.sampling import MAX_TOKENS, WireParams
from hetero_pd.serving.router.worker_client import WorkerClient

Policy = Literal["round_robin", "least_loaded", "prefix_aware", "kv_aware"]
FailurePolicy = Literal["recompute", "retry", "fail"]
POLICIES: tuple[str, ...] = get_args(Policy)
FAILURE_POLICIES: tuple[str, ...] = get_args(FailurePolicy)
#: The share of a TPOT target's headroom elastic prefill spends: the rest absorbs what the
#: averages miss (prompts arrive in bursts, steps slow as the batch grows).
SLO_SHARE = 0.5
#: The most prompt tokens per output token a TPOT target lets a request absorb: far more
#: than any prompt, and finite whatever a heartbeat's costs (a denormal one would be inf).
MAX_TOKENS_PER_OUTPUT = 1e6


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """How workers are picked (a deployment's `router:` section checks the values)."""

    policy: Policy = "least_loaded"
    # Conditional disaggregation: prefill on the decode worker itself when the prompt part
    # not already cached there is at most this long, ...
    local_prefill_max_tokens: int = 32
    # ... or (elastic) when the decode worker's batch is empty while the prefill workers
    # are busy (it would only wait for the KV), or when the prefill workers' backlog is
    # longer than the decode worker's whole job and the prompt is short enough for the
    # requests in flight there (`busy_prompt_limit`): each prompt token a decode worker
    # computes delays every running request's next token, so a longer prompt goes there
    # while requests run only when every prefill worker has more than
    # `prefill_queue_limit_tokens` queued. Without elastic prefill, only then.
    elastic_prefill: bool = True
    #: The longest prompt a decode worker with requests in flight always takes.
    elastic_busy_max_tokens: int = 64
    #: ... and longer ones while every request there can absorb it: each may be stalled by
    #: prompts computed beside it of at most this many tokens per output token of its own
    #: (its max_tokens), all of them together, which its TPOT spreads over its output. On a
    #: CPU a prompt token costs ~1/25 of a decode step (a 256-token prompt ~1.1 s, a step
    #: ~0.1 s, the default model on one core), so 6 raise a request's TPOT by about a
    #: quarter at most: the 1.25 PD's TPOT interference is held to (docs/BENCHMARKS.md
    #: section 3). 0: off.
    elastic_tokens_per_output: float = 6.0
    #: A TPOT target in milliseconds (0: none). With one, a request decoding on a worker
    #: absorbs as many prompt tokens per output token as `SLO_SHARE` of the target's headroom
    #: over the worker's decode step buys at its cost per prompt token (both as its
    #: heartbeat last reported them), when that is more than `elastic_tokens_per_output`.
    tpot_slo_ms: float = 0.0
    prefill_queue_limit_tokens: int = 8192
    #: A decode worker with more of its KV cache in use than this takes no prompt itself.
    elastic_kv_limit: float = 0.85
    block_size: int = 16
    #: kv_aware: weight of the prompt blocks a worker would compute against the blocks of
    #: work it has (Dynamo's kv-overlap-score-weight): higher favours cache hits, lower
    #: spreads load.
    kv_overlap_weight: float = 1.0
    #: kv_aware: when another worker holds at least this many more prompt tokens than the
    #: one chosen to compute the prompt, the chosen one pulls them (0: never pull).
    prefix_pull_min_tokens: int = 32
    #: A decode worker serves the prompt's prefix from its own cache and receives only the
    #: rest's KV (suffix-only transfer); False sends the whole prompt's KV (for comparison).
    decode_prefix_reuse: bool = True
    #: How long a pull may take before the puller computes the prefix itself.
    prefix_pull_timeout_s: float = 10.0


class Chooser:
    """Picks workers by the configured policy (see the module docstring)."""

    def __init__(self, cfg: RoutingConfig) -> None:
        self.cfg = cfg
        # One round-robin counter per candidate set: picking the decode worker must not
        # advance the prefill rotation (with one decoder and two prefillers, a shared counter
        # would send every prompt to the same prefill worker).
        self._rr: dict[tuple[str, ...], itertools.count[int]] = {}

    def hashes(self, prompt_ids: list[int] | None) -> list[int]:
        """The prompt's full blocks' chained hashes, as the workers' engines hash them."""
        return prompt_block_hashes(prompt_ids, self.cfg.block_size) if prompt_ids else []

    def pick(
        self, candidates: list[WorkerClient], prompt_ids: list[int] | None = None
    ) -> tuple[WorkerClient, int]:
        """Returns (worker, number of prompt tokens it likely has cached)."""
        if not candidates:
            raise LookupError("no live worker")
        policy = self.cfg.policy
        if policy == "round_robin":
            counter = self._rr.setdefault(tuple(w.worker_id for w in candidates), itertools.count())
            return candidates[next(counter) % len(candidates)], 0
        least = min(candidates, key=lambda w: w.load_score)
        if policy == "least_loaded" or not prompt_ids:
            return least, 0
        hashes = self.hashes(prompt_ids)
        matched = [w.held.matched(hashes) * self.cfg.block_size for w in candidates]
        if policy == "kv_aware":
            costs = [
                self.cost(w, len(prompt_ids), m) for w, m in zip(candidates, matched, strict=True)
            ]
            i = min(range(len(candidates)), key=lambda i: (costs[i], candidates[i].load_score))
            return candidates[i], matched[i]
        i = max(range(len(candidates)), key=lambda i: matched[i])
        best = candidates[i]
        if matched[i] and best.load_score <= 2 * least.load_score + 512:
            return best, matched[i]
        return least, 0

    def cost(self, worker: WorkerClient, prompt_len: int, cached_tokens: int) -> float:
        """Dynamo's KV-aware cost, in blocks: weight x the prompt blocks `worker` would
        compute + the blocks of work it has (queued prompt tokens and KV in use)."""
        bs = self.cfg.block_size
        prefill_blocks = (prompt_len - cached_tokens) / bs
        active_blocks = worker.load.kv_usage * worker.info.num_blocks
        return (
            self.cfg.kv_overlap_weight * prefill_blocks
            + worker.backlog_tokens / bs
            + (active_blocks)
        )

    def holder(
        self, workers: list[WorkerClient], prompt_ids: list[int]
    ) -> tuple[WorkerClient | None, int]:
        """The worker holding the longest prefix of the prompt's blocks a pull may take
        (never the block of the last token, which the engine always computes) and its
        length in tokens; (None, 0) when none holds one."""
        bs = self.cfg.block_size
        hashes = self.hashes(prompt_ids)[: (len(prompt_ids) - 1) // bs]
        best, most = None, 0
        for w in workers:
            n = w.held.matched(hashes)
            if n > most:
                best, most = w, n
        return best, most * bs

    def record(self, worker: WorkerClient, prompt_ids: list[int]) -> None:
        """Notes that `worker` is about to hold the KV of this prompt's full blocks."""
        if self.cfg.policy in ("prefix_aware", "kv_aware"):
            worker.held.record(self.hashes(prompt_ids))

    def prefill_locally(
        self,
        prompt_len: int,
        cached_tokens: int,
        prefill: list[WorkerClient],
        decode: WorkerClient,
    ) -> bool:
        """Conditional disaggregation (after NVIDIA Dynamo), by prompt, queue and load.

        Backlogs are prompt tokens not yet computed: what the router sent and has not seen
        done, or what the worker's last heartbeat reported queued, whichever is larger.
        The decode worker's batch: the requests the router has there (decoding, or
        waiting for their KV, which will decode beside whatever it computes next) or its
        last heartbeat's, whichever is larger; the request being placed is not among
        them yet."""
        if not prefill:
            return True
        uncached = prompt_len - cached_tokens
        if uncached <= self.cfg.local_prefill_max_tokens:
            return True
        prefill_backlog = min(w.backlog_tokens for w in prefill)
        hopeless = prefill_backlog > self.cfg.prefill_queue_limit_tokens
        if not self.cfg.elastic_prefill:
            return hopeless
        load = decode.load
        if load.kv_usage >= self.cfg.elastic_kv_limit:
            return False
        decode_backlog = decode.backlog_tokens
        batch = max(load.running + load.remote, len(decode.inflight))
        if batch == 0 and decode_backlog == 0:
            # decode would idle until the KV came: it computes the prompt now
            return prefill_backlog > 0
        if batch and uncached > self.busy_prompt_limit(decode):
            return hopeless  # its chunks would slow every running request's steps
        return prefill_backlog >= decode_backlog + uncached

    def stall_until(self, decode: WorkerClient, params: WireParams) -> int:
        """For a request about to decode on `decode`: the count of the worker's
        `prompt_tokens_given` past which prompts computed beside it would stall it more
        than its output absorbs (`tokens_per_output` x its max_tokens)."""
        allowance = int(self.tokens_per_output(decode) * output_tokens(params))
        return decode.prompt_tokens_given + allowance

    def tokens_per_output(self, decode: WorkerClient) -> float:
        """The prompt tokens computed on `decode` a request there absorbs per output token:
        `elastic_tokens_per_output`, or what `SLO_SHARE` of the TPOT target's headroom over
        the worker's decode step buys, whichever is more. A step with prompt tokens costs
        their count x their cost more than a decode step; spread over a request's output,
        that is the TPOT it adds."""
        least = self.cfg.elastic_tokens_per_output
        target, load = self.cfg.tpot_slo_ms / 1000, decode.load
        if not (target and load.decode_step_s and load.prompt_token_s):
            return least  # no target, or the worker has not measured both costs yet
        buys = SLO_SHARE * (target - load.decode_step_s) / load.prompt_token_s
        return min(max(least, buys), MAX_TOKENS_PER_OUTPUT)  # a tiny cost buys no infinity

    def busy_prompt_limit(self, decode: WorkerClient) -> int:
        """The longest prompt (its uncached part) elastic prefill gives `decode` while
        requests are in flight there: `elastic_busy_max_tokens`, or more while every
        request the router has decoding there can still absorb that stall (the least
        allowance left, `stall_until`). Requests only a heartbeat reports (the router does
        not know their length) do not raise it."""
        floor = self.cfg.elastic_busy_max_tokens
        ends = [end for end in decode.inflight.values() if end is not None]
        if not ends:
            return floor
        return max(floor, min(ends) - decode.prompt_tokens_given)


def output_tokens(params: WireParams) -> int:
    """The tokens a request decodes at most: its max_tokens (None: as many as the wire
    allows, i.e. until EOS or the context is full)."""
    return params.max_tokens or MAX_TOKENS

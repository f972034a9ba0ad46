"""The engine's side of speculative decoding: proposals for the running requests before a
step is scheduled, and counts of what verification accepted (vLLM's spec_decode metrics).

A request whose last MISSES_BEFORE_BACKOFF verified runs accepted nothing stops proposing
for a while (BACKOFF_STEPS, doubling up to MAX_BACKOFF_STEPS while it keeps missing, reset by
an accepted token): where proposals keep failing, its steps run as plain decode steps."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hetero_pd.engine.request import Request
from hetero_pd.engine.scheduler import SchedulerOutput
from hetero_pd.engine.spec.config import SpeculativeConfig
from hetero_pd.engine.spec.draft import DraftProposer
from hetero_pd.engine.spec.ngram import NgramProposer

MISSES_BEFORE_BACKOFF = 3
BACKOFF_STEPS = 4
MAX_BACKOFF_STEPS = 64


@dataclass(slots=True)
class SpecDecodingStats:
    """Totals since the engine started (vLLM's `spec_decode_*` counters)."""

    num_drafts: int = 0  # verified proposal runs
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # accepted proposals by position in their run
    accepted_per_pos: list[int] = field(default_factory=list)
    propose_s: float = 0.0  # time spent proposing (the draft model's passes, or lookups)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying step yields per sequence: 1 + accepted proposals (mean)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


class Speculator:
    def __init__(
        self, config: SpeculativeConfig, max_model_len: int, draft: DraftProposer | None = None
    ) -> None:
        """`draft`: the draft model's proposer (method draft_model), else prompt lookup."""
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(config)
        self.draft = draft
        self.stats = SpecDecodingStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._misses: dict[str, int] = {}  # request id -> verified runs in a row, none accepted
        self._pause: dict[str, tuple[int, int]] = {}  # request id -> (steps left, backoff)

    def propose(self, running: list[Request]) -> None:
        """Sets the proposals of every running request that decodes next (none for a
        request with a grammar, whose mask needs each token first, or an edge split's)."""
        start = time.perf_counter()
        live = {req.request_id for req in running}
        self._misses = {k: v for k, v in self._misses.items() if k in live}
        self._pause = {k: v for k, v in self._pause.items() if k in live}
        reqs, rooms = [], []
        for req in running:
            req.spec_token_ids = []
            if req.num_tokens - req.num_computed_tokens != 1 or self._paused(req.request_id):
                continue
            if req.grammar is not None or req.prompt_hidden is not None:
                continue
            # The step yields at most one token past its proposals: none past the limits.
            room = self.max_model_len - req.num_tokens
            if req.params.max_tokens is not None:
                room = min(room, req.params.max_tokens - req.num_output_tokens)
            reqs.append(req)
            rooms.append(room - 1)
        if self.draft is not None:
            self.draft.release_except(live)
            proposals = self.draft.propose(reqs, rooms) if reqs else []
        else:
            proposals = [
                self.proposer.propose(r.all_token_ids, n) for r, n in zip(reqs, rooms, strict=True)
            ]
        for req, proposal in zip(reqs, proposals, strict=True):
            req.spec_token_ids = proposal
        self.stats.propose_s += time.perf_counter() - start

    def observe(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        """Counts a step's verified runs (before any cut at the request's end)."""
        for chunk in out.chunks:
            if not chunk.num_spec:
                continue
            rid = chunk.request.request_id
            accepted = len(sampled[rid]) - 1
            self._note(rid, accepted)
            s = self.stats
            s.num_drafts += 1
            s.num_draft_tokens += chunk.num_spec
            s.num_accepted_tokens += accepted
            for pos in range(accepted):
                s.accepted_per_pos[pos] += 1

    def _paused(self, request_id: str) -> bool:
        """Whether the request sits out this step's proposals (and counts the step)."""
        left, backoff = self._pause.get(request_id, (0, 0))
        if left <= 0:
            return False
        self._pause[request_id] = (left - 1, backoff)
        return True

    def _note(self, request_id: str, accepted: int) -> None:
        if accepted:
            self._misses.pop(request_id, None)
            self._pause.pop(request_id, None)
            return
        misses = self._misses.get(request_id, 0) + 1
        self._misses[request_id] = misses
        if misses >= MISSES_BEFORE_BACKOFF:
            _, backoff = self._pause.get(request_id, (0, 0))
            backoff = min(2 * backoff, MAX_BACKOFF_STEPS) if backoff else BACKOFF_STEPS
            self._pause[request_id] = (backoff, backoff)
            self._misses[request_id] = MISSES_BEFORE_BACKOFF - 1  # one more miss: longer


def build_speculator(
    config: SpeculativeConfig | None,
    max_model_len: int,
    target: Path,
    draft_kv: tuple[int, int, int],
    device: torch.device,
    dtype: torch.dtype,
) -> Speculator | None:
    """The engine's speculator (None without a config); `draft_kv` = (blocks, block size,
    tokens a step may compute): the draft model's own cache and catch-up budget."""
    if config is None:
        return None
    draft = None
    if config.model is not None:
        num_blocks, block_size, max_tokens = draft_kv
        draft = DraftProposer(
            config.model, target, config.num_speculative_tokens, num_blocks, block_size,
            device, dtype, max_model_len, max_tokens,
        )  # fmt: skip
    return Speculator(config, max_model_len, draft)

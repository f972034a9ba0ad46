"""The engine's side of speculative decoding: proposals for the running requests before a
step is scheduled, and counts of what verification accepted (vLLM's spec_decode metrics).

A request whose last MISSES_BEFORE_BACKOFF verified runs accepted nothing stops proposing
for a while (BACKOFF_STEPS, doubling up to MAX_BACKOFF_STEPS while it keeps missing, reset by
an accepted token): where proposals keep failing, its steps run as plain decode steps."""

from __future__ import annotations

from dataclasses import dataclass, field

from hetero_pd.engine.request import Request
from hetero_pd.engine.scheduler import SchedulerOutput
from hetero_pd.engine.spec.config import SpeculativeConfig
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

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying step yields per sequence: 1 + accepted proposals (mean)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = NgramProposer(config)
        self.stats = SpecDecodingStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self._misses: dict[str, int] = {}  # request id -> verified runs in a row, none accepted
        self._pause: dict[str, tuple[int, int]] = {}  # request id -> (steps left, backoff)

    def propose(self, running: list[Request]) -> None:
        """Sets the proposals of every running request that decodes next (none for a
        request with a grammar, whose mask needs each token first, or an edge split's)."""
        live = {req.request_id for req in running}
        self._misses = {k: v for k, v in self._misses.items() if k in live}
        self._pause = {k: v for k, v in self._pause.items() if k in live}
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
            req.spec_token_ids = self.proposer.propose(req.all_token_ids, room - 1)

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

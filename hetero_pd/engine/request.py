"""Per-request state the scheduler and the engine share."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from hetero_pd.engine.structured import GrammarMatcher
    from hetero_pd.outputs import PromptLogprobs, SampleLogprobs
    from hetero_pd.sampling_params import SamplingParams

_arrival_counter = itertools.count()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    # prefill role: prompt done, first token sampled, blocks held until the KV is handed off
    KV_READY = "kv_ready"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
}
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True, eq=False)
class Request:
    """One generation request: its tokens, its progress and its KV blocks."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0  # lower runs first (as in vLLM)
    arrival_time: float = field(default_factory=time.monotonic)
    arrival_seq: int = field(default_factory=lambda: next(_arrival_counter))
    status: RequestStatus = RequestStatus.WAITING
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    generator: torch.Generator | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Split (edge) requests: the input of each position is a hidden state received from the
    # device, not a token id; the prompt's token ids are placeholders the engine never sees.
    prompt_hidden: torch.Tensor | None = None  # [num_prompt_tokens, hidden]
    hidden_rows: list[torch.Tensor] = field(default_factory=list)  # one [1, hidden] per output
    # An edge prompt in a whole-model engine ("prompt only" edge mode): the device ran layers
    # [0, k) on the prompt and sent their KV, [k, 2, num_prompt_tokens, kv_heads, head_dim],
    # with `prompt_hidden` entering layer k; outputs then run every layer from token ids.
    early_kv: torch.Tensor | None = None
    # SamplingParams.logprobs / prompt_logprobs, recorded as the tokens are computed (see
    # hetero_pd.engine.logprobs): one entry per output token; one per prompt position.
    output_logprobs: SampleLogprobs = field(default_factory=list)
    cumulative_logprob: float = 0.0
    prompt_logprobs: PromptLogprobs = field(default_factory=list)
    # SamplingParams.structured_outputs: the grammar's state after the tokens so far.
    grammar: GrammarMatcher | None = None
    # Speculative decoding: tokens proposed to follow all_token_ids, verified next step.
    spec_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_ready_tokens(self) -> int:
        """Tokens whose input is available: all of them, unless a split request still waits
        for the device's hidden state of its newest token."""
        if self.prompt_hidden is None:
            return len(self.all_token_ids)
        if self.early_kv is not None:
            # A chunk never spans the prompt's end: the prompt enters at layer k, outputs at 0.
            n = len(self.prompt_hidden)
            return n if self.num_computed_tokens < n else len(self.all_token_ids)
        return min(len(self.all_token_ids), len(self.prompt_hidden) + len(self.hidden_rows))

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    def drop_outputs_after(self, num_output_tokens: int) -> None:
        """Forgets the output tokens past the first `num_output_tokens` (a speculative run
        cut by a stop), with their logprobs."""
        del self.all_token_ids[self.num_prompt_tokens + num_output_tokens :]
        if len(self.output_logprobs) > num_output_tokens:
            del self.output_logprobs[num_output_tokens:]
            # summed again in the same order, so the total is the one a plain run has
            self.cumulative_logprob = 0.0
            for entry, token in zip(self.output_logprobs, self.output_token_ids, strict=False):
                self.cumulative_logprob += entry[token].logprob

    def sort_key(self) -> tuple[int, int]:
        return (self.priority, self.arrival_seq)

"""What generation returns (shaped like vLLM's RequestOutput so users know it)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """One token's log-probability at one position (vLLM's ``Logprob``)."""

    logprob: float  # -inf for a banned token
    rank: int  # 1 for the most likely token; ties share the larger rank (as vLLM counts)
    decoded_token: str | None = None  # the token's own text, filled when outputs are made


#: Per generated token: the chosen token first, then the requested alternatives by rank.
SampleLogprobs = list[dict[int, Logprob]]
#: Per prompt token: None for the first (nothing predicts it), then as SampleLogprobs.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str  # the whole output text so far (stop strings removed)
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that matched
    delta_text: str = ""  # text added by this step (for streaming)
    delta_token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None  # when SamplingParams.logprobs is set
    cumulative_logprob: float | None = None  # sum of the chosen tokens' logprobs


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # when SamplingParams.prompt_logprobs is set

"""Log-probabilities of chosen tokens and their most likely alternatives (vLLM's shapes).

Sampled tokens: from the logits the sampler chose from, after bans, bias, penalties and the
temperature (1 for greedy rows), before top-k/top-p/min-p (see SamplingParams). Prompt
tokens: the model's own log-softmax at the previous position, computed while the prompt is
prefilled (a request asking for them reads nothing from the prefix cache, or its cached
positions would have no logits).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hetero_pd.engine.request import Request
from hetero_pd.engine.scheduler import ScheduledChunk
from hetero_pd.outputs import Logprob, PromptLogprobs, SampleLogprobs

#: Prompt rows turned into logits at once (a [rows, vocab] float32 tensor each).
PROMPT_ROWS_PER_PASS = 256


def token_logprobs(
    logprobs: torch.Tensor, chosen: Sequence[int], num_top: Sequence[int]
) -> list[dict[int, Logprob]]:
    """Per row of ``[rows, vocab]`` log-probabilities: the chosen token's entry, then the
    ``num_top[row]`` most likely tokens by rank (the chosen one is not repeated)."""
    device = logprobs.device
    chosen_t = torch.tensor(list(chosen), device=device).unsqueeze(1)
    chosen_lp = logprobs.gather(1, chosen_t)
    # vLLM's rank: how many tokens are at least as likely as the chosen one.
    ranks = (logprobs >= chosen_lp).sum(dim=1).tolist()
    k = max(num_top, default=0)
    top_vals, top_ids = ([], []) if k == 0 else (t.tolist() for t in logprobs.topk(k, dim=1))
    out = []
    for row, (token, lp) in enumerate(zip(chosen, chosen_lp[:, 0].tolist(), strict=True)):
        entry = {token: Logprob(lp, ranks[row])}
        for rank in range(num_top[row]):
            tid = top_ids[row][rank]
            if tid not in entry:
                entry[tid] = Logprob(top_vals[row][rank], rank + 1)
        out.append(entry)
    return out


def wants_prompt_logprobs(req: Request) -> bool:
    """Whether a request still has prompt positions to record (edge prompts have none: their
    token ids are placeholders)."""
    return (
        req.params.prompt_logprobs is not None
        and req.prompt_hidden is None
        and len(req.prompt_logprobs) < req.num_prompt_tokens
    )


def record_prompt_logprobs(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    chunks: Sequence[ScheduledChunk],
) -> None:
    """Records on each request that asks the prompt logprobs its chunk of this step yields.

    ``hidden`` is the step's ``[num_tokens, hidden]`` last hidden states, rows in chunk
    order. The row of position ``p`` predicts the token at ``p + 1``. A recomputed chunk
    (after preemption) records nothing twice."""
    row = 0
    for chunk in chunks:
        req = chunk.request
        first = row
        row += chunk.num_tokens
        if not wants_prompt_logprobs(req):
            continue
        if not req.prompt_logprobs:
            req.prompt_logprobs.append(None)  # nothing predicts the first prompt token
        start = req.num_computed_tokens
        # positions p whose next token is a prompt token not recorded yet
        lo = max(start, len(req.prompt_logprobs) - 1)
        hi = min(start + chunk.num_tokens, req.num_prompt_tokens - 1)
        for a in range(lo, hi, PROMPT_ROWS_PER_PASS):
            b = min(a + PROMPT_ROWS_PER_PASS, hi)
            rows = hidden[first + a - start : first + b - start]
            lp = torch.log_softmax(compute_logits(rows).float(), dim=-1)
            targets = req.prompt_token_ids[a + 1 : b + 1]
            n = req.params.prompt_logprobs or 0
            req.prompt_logprobs.extend(token_logprobs(lp, targets, [n] * len(targets)))


def adopt_remote_logprobs(
    req: Request,
    first_token: int,
    first: dict[int, Logprob] | None,
    prompt: PromptLogprobs | None,
) -> None:
    """A prompt computed on another worker: takes the logprobs it recorded there (its first
    token's and the prompt's) where the request asks for them, so that the outputs are the
    same as when the prompt is computed here. Raises ValueError when one is missing."""
    p = req.params
    if p.logprobs is not None:
        if first is None or first_token not in first:
            raise ValueError(
                f"request {req.request_id} asks for logprobs: the first token's "
                f"({first_token}) must come with its KV"
            )
        req.output_logprobs.append(first)
        req.cumulative_logprob += first[first_token].logprob
    if p.prompt_logprobs is not None and req.prompt_hidden is None:
        if prompt is None or len(prompt) != req.num_prompt_tokens:
            got = "none" if prompt is None else f"{len(prompt)} positions"
            raise ValueError(
                f"request {req.request_id} asks for prompt logprobs: all "
                f"{req.num_prompt_tokens} positions must come with its KV, got {got}"
            )
        req.prompt_logprobs = list(prompt)


def output_logprobs(req: Request) -> tuple[SampleLogprobs | None, float | None]:
    """The request's sampled-token logprobs so far and their sum (None when not asked)."""
    if req.params.logprobs is None:
        return None, None
    return list(req.output_logprobs), req.cumulative_logprob


def prompt_logprobs(req: Request) -> PromptLogprobs | None:
    """The request's prompt logprobs (complete once its prompt is computed)."""
    return None if req.params.prompt_logprobs is None else list(req.prompt_logprobs)


def decode_logprobs(tokenizer: Any, entries: Sequence[dict[int, Logprob] | None]) -> None:
    """Fills ``decoded_token`` (each token's own text) where it is missing."""
    for entry in entries:
        for token, lp in (entry or {}).items():
            if lp.decoded_token is None:
                lp.decoded_token = tokenizer.decode([token])

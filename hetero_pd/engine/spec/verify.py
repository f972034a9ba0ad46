"""Verification of proposed tokens: which of them the target model's own sampling keeps.

A sequence with proposals d_0 .. d_{k-1} is run as k + 1 query tokens
``[last, d_0, .., d_{k-1}]``; row j of its logits is the target's distribution p_j after
``d_0 .. d_{j-1}``. Row 0 is sampled as in any decode step; while the token sampled from row
j equals d_j, row j + 1 is sampled too. The run is every token sampled: the agreeing
proposals, then the first token that differs (or one past the last proposal).

This is rejection sampling (Leviathan et al. 2023, Chen et al. 2023) for a proposal
distribution q that is one-hot at d_j (prompt lookup, or a greedy draft): accept d_j with
probability min(1, p_j(d_j) / q(d_j)) = p_j(d_j), else draw from the residual
norm(max(0, p_j - q)) = p_j without d_j. Drawing t ~ p_j and accepting when t == d_j gives
exactly that: accepted with probability p_j(d_j), and on rejection t is distributed as p_j
conditioned on t != d_j. So every token comes from the target's distribution; greedy rows
take the argmax, so their output is the non-speculative one token for token.

Each row is sampled by `Sampler.sample_requests` with the request seeing the run so far as
its output (min_tokens bans, penalties' history and logprobs as in a plain step); a seeded
request draws once per sampled row, as a plain step draws once per token, so it yields the
same tokens as without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

import torch

from hetero_pd.engine.request import Request
from hetero_pd.engine.sampler import Sampler


def sample_runs(
    sampler: Sampler,
    logits: torch.Tensor,
    reqs: Sequence[Request],
    drafts: Sequence[list[int]],
    masks: Future[torch.Tensor] | None = None,
) -> list[list[int]]:
    """Per request, its run of tokens. ``logits``: ``[sum(1 + len(d)), vocab]``, the rows
    of request i (``1 + len(drafts[i])``) contiguous and in request order. ``masks``: what
    ``sampler.start_masks(reqs)`` returned (requests with proposals have no grammar)."""
    offsets, row = [], 0
    for d in drafts:
        offsets.append(row)
        row += 1 + len(d)
    first = logits if row == len(reqs) else logits[offsets]
    runs = [[t] for t in sampler.sample_requests(first, reqs, masks)]
    live = [i for i, d in enumerate(drafts) if d and runs[i][0] == d[0]]
    j = 1
    while live:
        sub = [reqs[i] for i in live]
        for i in live:  # the run so far is the request's output while its row is sampled
            reqs[i].all_token_ids.extend(runs[i])
        try:
            tokens = sampler.sample_requests(logits[[offsets[i] + j for i in live]], sub)
        finally:
            for i in live:
                del reqs[i].all_token_ids[-j:]
        for i, t in zip(live, tokens, strict=True):
            runs[i].append(t)
        j += 1
        live = [i for i in live if j <= len(drafts[i]) and runs[i][-1] == drafts[i][j - 1]]
    return runs

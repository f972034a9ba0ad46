"""What changes the logits before a token is chosen: ``min_tokens`` bans, ``logit_bias`` and
the repetition, frequency and presence penalties (applied in that order, as vLLM does).

Each function takes ``[num_rows, vocab]`` logits and one ``SamplingParams`` per row and
returns logits with the rows that ask for it changed; rows that ask for nothing keep their
values bit for bit (greedy rows must stay transformers' argmax)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hetero_pd.sampling_params import SamplingParams

#: (prompt token ids, output token ids) of one row: what the penalties look at.
History = tuple[Sequence[int], Sequence[int]]


def process_logits(
    logits: torch.Tensor,
    params: list[SamplingParams],
    suppress_token_ids: list[list[int]] | None = None,
    histories: list[History] | None = None,
) -> torch.Tensor:
    """``logits`` after bans, biases and penalties; the same tensor when no row has any.

    Biases and penalties are added in float32 (logits of the model's dtype are widened
    first, exactly); bans keep the dtype (-inf is exact in any). ``histories`` is needed
    (one per row) when a row has a penalty."""
    if suppress_token_ids is not None and any(suppress_token_ids):
        logits = suppress(logits, suppress_token_ids)
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    bias = any(p.logit_bias for p in params)
    if bias or rows:
        logits = logits.float()
    if bias:
        logits = apply_logit_bias(logits, params)
    if rows:
        if histories is None:
            raise ValueError("rows with penalties need the token history of each row")
        logits = apply_penalties(logits, params, histories, rows)
    return logits


def suppress(logits: torch.Tensor, suppress_token_ids: list[list[int]]) -> torch.Tensor:
    """Sets the listed token ids of each row to ``-inf``.

    Raises ValueError for an id outside the vocabulary: SamplingParams.check_token_ids
    refuses those when a request is admitted, so one here is a bug, and the engine fails
    that request alone."""
    vocab = logits.shape[-1]
    bad = [t for ids in suppress_token_ids for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"suppressed token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    row_idx = [row for row, ids in enumerate(suppress_token_ids) for _ in ids]
    col_idx = [t for ids in suppress_token_ids for t in ids]
    logits = logits.clone()
    logits[row_idx, col_idx] = float("-inf")
    return logits


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Adds each row's ``logit_bias`` to its logits (OpenAI: "added to the logits generated
    by the model prior to sampling")."""
    rows, cols, values = [], [], []
    for row, p in enumerate(params):
        for token, bias in (p.logit_bias or {}).items():
            rows.append(row)
            cols.append(token)
            values.append(bias)
    logits = logits.clone()
    logits[rows, cols] += torch.tensor(values, dtype=logits.dtype, device=logits.device)
    return logits


def token_counts(seqs: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``[len(seqs), vocab]`` float32: how often each token id occurs in each sequence."""
    width = max((len(s) for s in seqs), default=0)
    counts = torch.zeros(len(seqs), vocab + 1, device=device)
    if width:
        # Padding goes to an extra column that is dropped.
        idx = torch.tensor([list(s) + [vocab] * (width - len(s)) for s in seqs], device=device)
        counts.scatter_add_(1, idx, torch.ones(idx.shape, device=device))
    return counts[:, :vocab]


def apply_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[History],
    rows: list[int],
) -> torch.Tensor:
    """Repetition, frequency and presence penalties on ``rows``.

    repetition: a token seen in the prompt or the output has its logit divided by the
    penalty when positive, multiplied when negative (transformers' rule, also vLLM's);
    frequency and presence (OpenAI's definition, on output tokens only):
    ``mu[j] -= c[j] * alpha_frequency + (c[j] > 0) * alpha_presence``.
    """
    vocab, device = logits.shape[-1], logits.device
    x = logits[rows].float()
    out_counts = token_counts([histories[i][1] for i in rows], vocab, device)
    rep = torch.tensor([params[i].repetition_penalty for i in rows], device=device)
    if bool((rep != 1.0).any()):
        seen = (out_counts + token_counts([histories[i][0] for i in rows], vocab, device)) > 0
        r = rep.unsqueeze(1)
        x = torch.where(seen, torch.where(x > 0, x / r, x * r), x)
    freq = torch.tensor([params[i].frequency_penalty for i in rows], device=device)
    pres = torch.tensor([params[i].presence_penalty for i in rows], device=device)
    x = x - freq.unsqueeze(1) * out_counts - pres.unsqueeze(1) * (out_counts > 0).float()
    logits = logits.clone()
    logits[rows] = x.to(logits.dtype)
    return logits

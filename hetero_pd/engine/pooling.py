"""Embeddings of token sequences (/v1/embeddings): one prefill-only forward pass of the
whole model over a batch of inputs, pooled to one vector each.

Pooling: the last token's hidden state after the final norm, L2-normalised. vLLM's default
for a causal LM run as an embedding model (``LAST``, ``normalize``), and the one a causal
model's attention supports: only the last position has attended to the whole input (a mean
weighs early tokens that saw little of it as much as the last).

No KV stays: the pass writes its K/V into a scratch cache sized to the batch, dropped when it
returns, so embeddings never take blocks from the pool nor touch the prefix cache, and run
between the engine's steps on the worker's thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.nn.functional as F

from hetero_pd.models.attention import AttentionMetadata, PrefillSpan

if TYPE_CHECKING:
    from hetero_pd.engine.model_runner import ModelRunner

Ids = TypeVar("Ids", bound=Sequence[int])

#: Most tokens one forward pass takes by default (a longer input still goes alone). A worker
#: passes its engine's max_num_batched_tokens, so one pass costs no more than a prefill chunk.
MAX_BATCH_TOKENS = 4096


def batches(inputs: Sequence[Ids], max_tokens: int = MAX_BATCH_TOKENS) -> list[list[Ids]]:
    """`inputs` in order, cut into runs of at most `max_tokens` tokens (or one input)."""
    out: list[list[Ids]] = [[]]
    used = 0
    for ids in inputs:
        if out[-1] and used + len(ids) > max_tokens:
            out.append([])
            used = 0
        out[-1].append(ids)
        used += len(ids)
    return out


@torch.inference_mode()
def embed(
    runner: ModelRunner, inputs: Sequence[Sequence[int]], max_tokens: int = MAX_BATCH_TOKENS
) -> torch.Tensor:
    """``[len(inputs), hidden_size]`` float32 unit vectors, one per input, on the CPU: one
    forward pass per :func:`batches` run."""
    if runner.ranks is not None:
        raise ValueError("embeddings need tensor_parallel_size 1 (this worker runs TP > 1)")
    if runner.start_layer:
        raise ValueError("embeddings need the whole model (this worker starts at a split)")
    if any(not ids for ids in inputs):
        raise ValueError("an input to embed has no tokens")
    return torch.cat([_pass(runner, batch) for batch in batches(inputs, max_tokens)])


def _pass(runner: ModelRunner, batch: Sequence[Sequence[int]]) -> torch.Tensor:
    model, cfg, device, bs = runner.model, runner.cfg, runner.device, runner.block_size
    ids = [t for seq in batch for t in seq]
    positions = [p for seq in batch for p in range(len(seq))]
    ends = torch.tensor([len(seq) for seq in batch]).cumsum(0)
    spans = [PrefillSpan(int(e) - len(s), int(e)) for s, e in zip(batch, ends, strict=True)]
    # The scratch cache: one slot per token, in plain (nd) layout.
    blocks = -(-len(ids) // bs)
    dtype = runner.kv_caches[0][0].dtype
    scratch = [
        tuple(torch.empty(blocks, *cfg.kv_block_shape(bs), dtype=dtype, device=device)
              for _ in range(cfg.kv_tensors_per_layer))
        for _ in range(cfg.num_layers)
    ]  # fmt: skip
    meta = AttentionMetadata(slot_mapping=torch.arange(len(ids), device=device), prefills=spans)
    hidden = model(
        torch.tensor(positions, device=device),
        meta,
        scratch,
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
    )
    last = model.norm(hidden[(ends - 1).to(device)]).float()
    return F.normalize(last, dim=-1).cpu()

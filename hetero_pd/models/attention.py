"""Attention over a paged KV cache for batches that mix decode tokens and prefill chunks.

KV cache layout, per layer and per K/V (the transfer module addresses blocks by index)::

    cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot  = block_id * block_size + offset_in_block

A step's flat token batch holds the decode tokens first (one per sequence), then the
prefill chunks, each contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class PrefillSpan:
    """One sequence's prefill chunk inside the flat token batch."""

    start: int
    end: int
    # Both set only when the chunk attends to tokens already in the cache (a prefix):
    block_table: torch.Tensor | None = None  # [num_blocks]
    mask: torch.Tensor | None = None  # [chunk_len, context_len] bool, True = attend
    context_len: int = 0


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one step; built once, shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] long: where each token's K/V is written
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decode, max_blocks] long
    decode_mask: torch.Tensor | None = None  # [num_decode, 1, 1, max_blocks * block_size]
    prefills: list[PrefillSpan] = field(default_factory=list)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Writes this step's K/V into the cache, then attends. Returns [num_tokens, heads, dim]."""
    # q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    nd = meta.num_decode_tokens
    if nd:
        assert meta.decode_block_tables is not None
        group = q.shape[1] // num_kv_heads
        # Query heads sharing a KV head become that head's "query rows": [nd, kv_heads, group, dim]
        qd = q[:nd].view(nd, num_kv_heads, group, head_dim)
        kd = k_cache[meta.decode_block_tables].view(nd, -1, num_kv_heads, head_dim).transpose(1, 2)
        vd = v_cache[meta.decode_block_tables].view(nd, -1, num_kv_heads, head_dim).transpose(1, 2)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
        out[:nd] = od.reshape(nd, -1, head_dim)
    for span in meta.prefills:
        qp = q[span.start : span.end].transpose(0, 1)
        if span.block_table is None:
            kp = k[span.start : span.end].transpose(0, 1)
            vp = v[span.start : span.end].transpose(0, 1)
            op = F.scaled_dot_product_attention(
                qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            n = span.context_len
            kp = k_cache[span.block_table].view(-1, num_kv_heads, head_dim)[:n].transpose(0, 1)
            vp = v_cache[span.block_table].view(-1, num_kv_heads, head_dim)[:n].transpose(0, 1)
            op = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=span.mask, scale=scale, enable_gqa=True
            )
        out[span.start : span.end] = op.transpose(0, 1)
    return out

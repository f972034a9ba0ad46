"""Attention over a paged KV cache for batches that mix decode tokens and prefill chunks.

KV cache layout, per layer and per K/V (the transfer module addresses blocks by index)::

    cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot  = block_id * block_size + offset_in_block

The bytes inside a block are in the engine's KV layout (`meta.kv_layout`: `nd`, row-major
as the shape reads, or the NPU's `fractal_nz`; see transfer/kv_layouts.py, which owns the
slot mapping of each).

A step's flat token batch holds the decode tokens first (one per sequence), then the
prefill chunks, each contiguous.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from backends import paged_decode
from transfer.kv_layouts import ND, read_slots, write_slots


@dataclass(slots=True)
class PrefillSpan:
    """One sequence's prefill chunk inside the flat token batch."""

    start: int
    end: int
    # Both set only when the chunk attends to tokens already in the cache (a prefix):
    context_slots: torch.Tensor | None = None  # [context_len] cache slots of tokens 0..end-1
    mask: torch.Tensor | None = None  # [chunk_len, context_len] bool, True = attend


@dataclass(slots=True)
class AttentionMetadata:
    """Everything attention needs for one step; built once, shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] long: where each token's K/V is written
    num_decode_tokens: int = 0
    # Cache slots each decode token attends to, padded to the longest context:
    decode_slots: torch.Tensor | None = None  # [num_decode * max_context] long
    decode_mask: torch.Tensor | None = None  # [num_decode, 1, 1, max_context] bool
    prefills: list[PrefillSpan] = field(default_factory=list)
    kv_layout: str = ND  # byte order inside the cache's blocks (transfer.kv_layouts)
    # Decode attention through the backend's kernel (backends/paged_decode.py), which reads
    # K/V where they lie: ModelRunner sets it.
    native_decode: bool = False


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
    write_slots(k_cache, meta.slot_mapping, k, meta.kv_layout)
    write_slots(v_cache, meta.slot_mapping, v, meta.kv_layout)
    nd = meta.num_decode_tokens
    # A compiled step is decode-only (ModelRunner), and comparing the batch size with the
    # int nd would specialize it.
    if torch.compiler.is_compiling() or (nd == q.shape[0] and not meta.prefills):
        return _decode(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = _decode(q[:nd], k_cache, v_cache, meta, scale)
    for span in meta.prefills:
        # 4-D [1, heads, tokens, dim]: 3-D inputs take SDPA's slower math path, which also
        # rounds differently from transformers in bfloat16.
        qp = q[span.start : span.end].transpose(0, 1)[None]
        if span.context_slots is None:
            kp = k[span.start : span.end].transpose(0, 1)[None]
            vp = v[span.start : span.end].transpose(0, 1)[None]
            op = F.scaled_dot_product_attention(
                qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True
            )
        else:
            kp = read_slots(k_cache, span.context_slots, meta.kv_layout).transpose(0, 1)[None]
            vp = read_slots(v_cache, span.context_slots, meta.kv_layout).transpose(0, 1)[None]
            op = F.scaled_dot_product_attention(
                qp, kp, vp, attn_mask=span.mask, scale=scale, enable_gqa=True
            )
        out[span.start : span.end] = op[0].transpose(0, 1)
    return out


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence against its cached context."""
    assert meta.decode_slots is not None and meta.decode_mask is not None
    if meta.kv_layout == ND and (meta.native_decode or torch.compiler.is_compiling()):
        k_flat = k_cache.view(-1, *k_cache.shape[2:])
        v_flat = v_cache.view(-1, *v_cache.shape[2:])
        if not meta.native_decode:
            return _decode_fused(q, k_flat, v_flat, meta.decode_slots, meta.decode_mask, scale)
        # Compiled: the op (opaque to the compiler). Eager: the function behind it.
        kernel = paged_decode.paged_decode if torch.compiler.is_compiling() else paged_decode.decode
        od = kernel(q, k_flat, v_flat, meta.decode_slots, meta.decode_mask.reshape(-1), scale)
        return od.to(q.dtype)
    nd, num_kv_heads, head_dim = q.shape[0], k_cache.shape[2], k_cache.shape[3]
    # index_select on the flat cache is far cheaper than advanced indexing by block table.
    kd = read_slots(k_cache, meta.decode_slots, meta.kv_layout).view(nd, -1, num_kv_heads, head_dim)
    vd = read_slots(v_cache, meta.decode_slots, meta.kv_layout).view(nd, -1, num_kv_heads, head_dim)
    # q: [nd, heads, 1, dim]; kd, vd: [nd, kv_heads, max_context, dim] (strided views)
    od = F.scaled_dot_product_attention(
        q.unsqueeze(2),
        kd.transpose(1, 2),
        vd.transpose(1, 2),
        attn_mask=meta.decode_mask,
        scale=scale,
        enable_gqa=True,
    )
    return od.reshape(nd, -1, head_dim)


def _decode_fused(
    q: torch.Tensor,
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`_decode` written for a compiler: as sums of products over gathered cache rows, which
    inductor fuses into loops that read each K/V row from the paged cache where it lies, with
    no gathered copy (eager, this form would materialize large temporaries)."""
    nd, heads, head_dim = q.shape
    kv_heads = k_flat.shape[1]
    ctx_slots = slots.view(nd, -1)  # [nd, ctx]
    # Query heads grouped by the KV head they share: [nd, 1, kv_heads, group, dim].
    # Accumulated in float32 whatever the cache dtype, as SDPA's kernels do.
    qg = q.view(nd, 1, kv_heads, heads // kv_heads, head_dim).float()
    k = k_flat[ctx_slots].unsqueeze(3).float()  # [nd, ctx, kv_heads, 1, dim], never copied
    scores = (qg * k).sum(-1) * scale  # [nd, ctx, kv_heads, group]
    scores = scores.masked_fill(~mask.view(nd, -1, 1, 1), float("-inf"))
    p = torch.softmax(scores, dim=1)
    v = v_flat[ctx_slots].unsqueeze(3).float()
    out = (p.unsqueeze(-1) * v).sum(1)  # [nd, kv_heads, group, dim]
    return out.reshape(nd, heads, head_dim).to(q.dtype)

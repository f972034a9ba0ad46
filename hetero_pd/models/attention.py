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

import itertools
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
    # Causal prefill chunks (no cached prefix) through the kernel's AVX-512 loops
    # (`paged_decode.prefill_causal`), which ModelRunner sets where they run: faster than
    # SDPA's flash kernel over the same groups, which scores every block of the causal
    # mask's masked half too (SmolLM2's heads, 8 x 256 to 16 x 64 tokens, 1 and 2 threads,
    # a Zen 5 EPYC: 2.4-3.3x in bfloat16, 1.7-2.8x in float32). Chunks attending to a
    # cached prefix (a mask over the context) take the decode kernel, each row a query over
    # the context where it lies, where it reads the cache (`native_decode`), else SDPA.
    native_prefill: bool = False
    # `prefills` batched for SDPA (prefill_groups): built by the first layer, shared by all.
    groups: list[PrefillGroup] | None = None


@dataclass(slots=True)
class PrefillGroup:
    """Prefill chunks of one length (and one context length) attended in one SDPA call."""

    size: int  # chunks in the group
    tokens: int  # tokens per chunk
    # Where the group's tokens lie in the flat batch: from `start` on when its chunks lie
    # back to back (a view, no copy), else row by row in `rows` [size * tokens].
    start: int = 0
    rows: torch.Tensor | None = None
    # With a cached prefix: every chunk's context slots [size * context], mask
    # [size, 1, tokens, context]; without, causal attention within each chunk.
    context_slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    # The context slots once per row, for the decode kernel (built by the first layer that
    # asks): [size * tokens * context].
    row_slots: torch.Tensor | None = None


def prefill_groups(meta: AttentionMetadata, device: torch.device) -> list[PrefillGroup]:
    """The step's prefill chunks grouped by (length, context length), each group attended
    in one batched SDPA call instead of one call per chunk.

    Why by equal length and not padded or packed (measured with
    `scripts/bench_prefill_attention.py` on a 2-core AVX-512 BF16 EPYC, SmolLM2's 9 query
    / 3 KV heads of 64): what a call per chunk costs is not FLOPs but one parallel region
    per call, whose threads meet at a barrier; on a busy 2-core box one batched call over
    8 chunks of 256 is 1.4-2.2x faster than 8 calls in float32 and in bfloat16 (at one
    thread, no barrier, they tie). Batching chunks of one length is exact: SDPA's CPU
    flash kernel computes each (batch, head) alone, so every token's output equals the
    per-chunk call's to the bit, in bfloat16 too. Padding chunks of different lengths to
    one (a causal mask keeps pad keys out of real rows) is not: the kernel's blocks
    follow the padded length, which moves bfloat16 outputs by up to a rounding step
    (greedy tokens must equal transformers' per-prompt run), and its wasted rows made it
    0.3-0.9x as fast as per-chunk calls in float32 and at one thread. Packing all chunks
    into one block-diagonal call computes every chunk against every other (masked). So a
    step of different lengths runs one call per distinct length: one call in the common
    case of a batch of equal prompts (a benchmark's, or one system prompt's continuations).
    """
    if meta.groups is not None:
        return meta.groups
    buckets: dict[tuple[int, int], list[PrefillSpan]] = {}
    for span in meta.prefills:
        context = -1 if span.context_slots is None else span.context_slots.numel()
        buckets.setdefault((span.end - span.start, context), []).append(span)
    meta.groups = []
    for (tokens, context), spans in buckets.items():
        group = PrefillGroup(len(spans), tokens, spans[0].start)
        if any(b.start != a.end for a, b in itertools.pairwise(spans)):
            group.rows = torch.cat([torch.arange(s.start, s.end) for s in spans]).to(device)
        if context >= 0:
            group.context_slots = torch.cat([s.context_slots for s in spans])  # type: ignore[misc]
            group.mask = torch.stack([s.mask for s in spans])[:, None]  # type: ignore[misc]
        meta.groups.append(group)
    return meta.groups


def group_rows(x: torch.Tensor, group: PrefillGroup) -> torch.Tensor:
    """The group's tokens' rows of a flat batch tensor x [num_tokens, ...]."""
    if group.rows is None:
        return x[group.start : group.start + group.size * group.tokens]
    return x.index_select(0, group.rows)


def put_rows(out: torch.Tensor, group: PrefillGroup, rows: torch.Tensor) -> None:
    """Writes the group's rows (as `group_rows` took them) into out [num_tokens, ...]."""
    if group.rows is None:
        out[group.start : group.start + group.size * group.tokens] = rows
    else:
        out.index_copy_(0, group.rows, rows)


def group_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: PrefillGroup, scale: float
) -> torch.Tensor:
    """One SDPA call over a group: q [size * tokens, heads, d], k and v [size * keys,
    kv_heads, d] (keys: tokens, or the context) -> [size * tokens, heads, d_v]."""

    def batched(t: torch.Tensor) -> torch.Tensor:
        # 4-D [size, heads, tokens, dim]: 3-D inputs take SDPA's slower math path, which
        # also rounds differently from transformers in bfloat16.
        return t.view(group.size, -1, *t.shape[1:]).transpose(1, 2)

    o = F.scaled_dot_product_attention(
        batched(q),
        batched(k),
        batched(v),
        attn_mask=group.mask,
        is_causal=group.mask is None,
        scale=scale,
        enable_gqa=True,
    )
    return o.transpose(1, 2).reshape(-1, *o.shape[1:2], o.shape[-1])


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
    for g in prefill_groups(meta, q.device):
        if g.context_slots is None:
            kg, vg = group_rows(k, g), group_rows(v, g)
            if meta.native_prefill:
                # Named for the profiler (bench profile counts it as attention): a ctypes
                # call, not an op it would see.
                with torch.profiler.record_function("hetero_pd::prefill_causal"):
                    rows = paged_decode.prefill_causal(group_rows(q, g), kg, vg, g.tokens, scale)
                put_rows(out, g, rows)
                continue
        elif meta.native_prefill and meta.native_decode and meta.kv_layout == ND:
            with torch.profiler.record_function("hetero_pd::prefix_rows"):
                put_rows(out, g, _prefix_rows(group_rows(q, g), k_cache, v_cache, g, scale))
            continue
        else:
            kg = read_slots(k_cache, g.context_slots, meta.kv_layout)
            vg = read_slots(v_cache, g.context_slots, meta.kv_layout)
        put_rows(out, g, group_sdpa(group_rows(q, g), kg, vg, g, scale))
    return out


def _prefix_rows(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    group: PrefillGroup,
    scale: float,
) -> torch.Tensor:
    """A group of chunks over a cached prefix (their own rows written already), each row as
    a decode query over its chunk's context, read where it lies: in the served 1P1D run the
    decode worker's mixed steps split a prompt at the token budget, and SDPA over a gathered
    copy of these contexts took more of its time than every whole chunk's attention."""
    assert group.context_slots is not None and group.mask is not None
    if group.row_slots is None:
        context = group.context_slots.numel() // group.size
        per_chunk = group.context_slots.view(group.size, 1, context)
        group.row_slots = per_chunk.expand(-1, group.tokens, -1).reshape(-1)
    return _kernel(q, k_cache, v_cache, group.row_slots, group.mask.reshape(-1), scale)


def _kernel(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Each row of q [n, heads, dim] attends to its `slots` [n * ctx] of the cache (layout
    nd) where `mask` [n * ctx] is True, through the kernel; out in q's dtype (a bf16 cache's
    rounded by the kernel as it goes)."""
    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])
    # Compiled: the op (opaque to the compiler). Eager: the function behind it.
    kernel = paged_decode.paged_decode if torch.compiler.is_compiling() else paged_decode.decode
    bf16_out = q.dtype == k_flat.dtype == torch.bfloat16
    return kernel(q, k_flat, v_flat, slots, mask, scale, bf16_out=bf16_out).to(q.dtype)


def _decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence against its cached context."""
    assert meta.decode_slots is not None and meta.decode_mask is not None
    if meta.kv_layout == ND and meta.native_decode:
        return _kernel(q, k_cache, v_cache, meta.decode_slots, meta.decode_mask.reshape(-1), scale)
    if meta.kv_layout == ND and torch.compiler.is_compiling():
        k_flat = k_cache.view(-1, *k_cache.shape[2:])
        v_flat = v_cache.view(-1, *v_cache.shape[2:])
        return _decode_fused(q, k_flat, v_flat, meta.decode_slots, meta.decode_mask, scale)
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

"""Multi-head latent attention (DeepSeek-V2/V3) over a paged latent KV cache.

Each token's keys and values are one low-rank latent c_kv (kv_lora_rank, RMS-normalised)
that `kv_b_proj` expands into per-head k_nope and v, plus one roped key part k_pe
(qk_rope_head_dim) that every head shares. The cache keeps only what the heads are made of:

    cache (one tensor per layer): [num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]
    row of a token:               | c_kv (kv_lora_rank) | k_pe (qk_rope_head_dim) |

One tensor, not a (K, V) pair: the transfer region, the KV tiers and the int8 codec take
one block shape for every tensor of a region (`KVRegion.block_shape`), and c_kv and k_pe
differ in width; as one single-"head" row they are blocks like any other (tensors_per_layer
1), so transfer, prefix cache, tiers, codec and per-role dtype conversion move them with no
MLA case of their own. The int8 codec scales each token's row as a whole.

Prefill expands the latents into per-head K and V and runs SDPA. Decode never expands the
cache: the query's nope part is absorbed into latent space through kv_b_proj's K half

    score = q_nope . (W_uk c) + q_pe . k_pe = (W_uk^T q_nope | q_pe) . (c | k_pe)

so attention is one-KV-head attention straight over the cached rows (values: their c
part), and the result goes through kv_b_proj's V half (W_uv) per head afterwards.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hetero_pd.models.attention import (
    AttentionMetadata,
    group_rows,
    group_sdpa,
    prefill_groups,
    put_rows,
)
from hetero_pd.models.config import MLAConfig, ModelConfig
from hetero_pd.models.llama import KVCache, Linear, RMSNorm
from hetero_pd.models.parallel import SINGLE, Parallel
from hetero_pd.models.rotary import apply_rope_swapped
from transfer.kv_layouts import read_slots, write_slots

# transformers' DeepseekV3 builds q_a_layernorm and kv_a_layernorm without rms_norm_eps.
_LORA_NORM_EPS = 1e-6


class MLAttention(nn.Module):
    """DeepSeek-V3's attention block; checkpoint names as transformers' DeepseekV3Attention.
    cfg: this rank's shapes (its heads, parallel.shard_config); o_proj is row-parallel, the
    latent projection whole on every rank (parallel.py)."""

    def __init__(self, cfg: ModelConfig, tp: Parallel = SINGLE) -> None:
        super().__init__()
        assert cfg.mla is not None
        m: MLAConfig = cfg.mla
        self.m, self.num_heads, self.tp = m, cfg.num_heads, tp
        qk_head_dim = m.qk_nope_head_dim + m.qk_rope_head_dim
        hidden, q_out = cfg.hidden_size, cfg.num_heads * qk_head_dim
        if m.q_lora_rank is None:
            self.q_proj = Linear(hidden, q_out, bias=False)
        else:
            self.q_a_proj = Linear(hidden, m.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, _LORA_NORM_EPS)
            self.q_b_proj = Linear(m.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, m.kv_lora_rank + m.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, _LORA_NORM_EPS)
        # A plain nn.Linear: decode reads its weight (absorption), which a kernel may drop.
        self.kv_b_proj = nn.Linear(
            m.kv_lora_rank, cfg.num_heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False
        )
        self.o_proj = Linear(cfg.num_heads * m.v_head_dim, hidden, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        kv: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """x [num_tokens, hidden]; cos, sin_signed [num_tokens, 1, qk_rope_head_dim]."""
        m, heads = self.m, self.num_heads
        if m.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        # q_nope [N, heads, nope], q_pe [N, heads, rope]
        q_nope, q_pe = q.view(x.shape[0], heads, -1).split(
            [m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1
        )
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], -1)
        k_pe = k_pe[:, None]  # [N, 1, rope]: the one key part every head shares
        if m.rope_interleave:
            q_pe, k_pe = _deinterleave(q_pe), _deinterleave(k_pe)
        q_pe = apply_rope_swapped(q_pe, cos, sin_signed)
        k_pe = apply_rope_swapped(k_pe, cos, sin_signed)
        rows = torch.cat((self.kv_a_layernorm(c_kv)[:, None], k_pe), dim=-1)  # [N, 1, r + rope]
        o = mla_paged_attention(q_nope, q_pe, rows, kv[0], meta, self.kv_b_proj.weight, m)
        return self.tp.all_reduce(self.o_proj(o.reshape(x.shape[0], heads * m.v_head_dim)))


def _deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Rope dims laid out in pairs (x0, x1), (x2, x3), ... -> (x0, x2, ..) | (x1, x3, ..):
    rotate-half rope on the result is transformers' interleaved rope, to the bit (q and k
    are permuted alike, so their dot products are unchanged)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def mla_paged_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    rows: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    kv_b: torch.Tensor,
    m: MLAConfig,
) -> torch.Tensor:
    """Writes this step's latent rows into the cache, then attends; returns
    [num_tokens, heads, v_head_dim]. kv_b: kv_b_proj's weight [heads * (nope + v), r]."""
    write_slots(cache, meta.slot_mapping, rows, meta.kv_layout)
    nd = meta.num_decode_tokens
    if torch.compiler.is_compiling() or (nd == q_nope.shape[0] and not meta.prefills):
        return _decode(q_nope, q_pe, cache, meta, kv_b, m)
    out = q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], m.v_head_dim)
    if nd:
        out[:nd] = _decode(q_nope[:nd], q_pe[:nd], cache, meta, kv_b, m)
    for g in prefill_groups(meta, q_nope.device):
        q = torch.cat((group_rows(q_nope, g), group_rows(q_pe, g)), dim=-1)
        if g.context_slots is None:
            k, v = _expand(group_rows(rows, g), kv_b, m)
        else:
            k, v = _expand(read_slots(cache, g.context_slots, meta.kv_layout), kv_b, m)
        put_rows(out, g, group_sdpa(q, k, v, g, m.softmax_scale))
    return out


def _expand(rows: torch.Tensor, kv_b: torch.Tensor, m: MLAConfig) -> tuple[torch.Tensor, ...]:
    """Latent rows [T, 1, r + rope] -> per-head k [T, heads, nope + rope], v [T, heads, v]
    (what transformers' `expand_kv` computes)."""
    c, k_pe = rows[:, 0].split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
    kv = F.linear(c, kv_b).view(rows.shape[0], -1, m.qk_nope_head_dim + m.v_head_dim)
    k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
    k = torch.cat((k_nope, k_pe[:, None].expand(-1, kv.shape[1], -1)), dim=-1)
    return k, v


def _decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    meta: AttentionMetadata,
    kv_b: torch.Tensor,
    m: MLAConfig,
) -> torch.Tensor:
    """One query token per sequence against its cached latents, by weight absorption."""
    assert meta.decode_slots is not None and meta.decode_mask is not None
    nd, heads = q_nope.shape[0], q_nope.shape[1]
    w = kv_b.view(heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)
    w_uk, w_uv = w.split([m.qk_nope_head_dim, m.v_head_dim], dim=1)
    # q in latent space: [nd, heads, r], then with its rope part [nd, heads, r + rope]
    q_latent = torch.einsum("nhd,hdr->nhr", q_nope, w_uk)
    q = torch.cat((q_latent, q_pe), dim=-1)
    ctx = read_slots(cache, meta.decode_slots, meta.kv_layout).view(nd, 1, -1, q.shape[-1])
    # One KV "head" for all query heads: [nd, heads, 1, r] after attention.
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2),
        ctx,
        ctx[..., : m.kv_lora_rank],
        attn_mask=meta.decode_mask,
        scale=m.softmax_scale,
        enable_gqa=True,
    )
    return torch.einsum("nhr,hvr->nhv", o[:, :, 0], w_uv)

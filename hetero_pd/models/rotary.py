"""Rotary position embeddings (default, linear and llama3 scaling), computed once as tables."""

from __future__ import annotations

import math

import torch

from hetero_pd.models.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    dim = cfg.head_dim
    # Same formula and dtypes as transformers, so positions encode bit-identically.
    inv_freq = 1.0 / (
        cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim)
    )
    params = dict(cfg.rope_params)
    if cfg.rope_type == "linear":
        inv_freq = inv_freq / params.get("factor", 1.0)
    elif cfg.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, params)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, params: dict[str, float]) -> torch.Tensor:
    factor = params.get("factor", 8.0)
    low_freq_factor = params.get("low_freq_factor", 1.0)
    high_freq_factor = params.get("high_freq_factor", 4.0)
    old_context = params.get("original_max_position_embeddings", 8192.0)
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_table(cfg: ModelConfig, max_positions: int) -> torch.Tensor:
    """cos and sin for every position: [max_positions, 2, head_dim], float32."""
    inv_freq = inverse_frequencies(cfg)
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = t[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return torch.stack((emb.cos(), emb.sin()), dim=1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim]; cos, sin: [num_tokens, 1, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated, for `apply_rope_swapped`."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope_swapped(
    x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
) -> torch.Tensor:
    """`apply_rope` bit for bit, in fewer ops: swapping x's halves times `signed_sin(sin)`
    is rotate_half(x) * sin. x: [num_tokens, heads, head_dim] (any strides)."""
    half = x.shape[-1] // 2
    out = x * cos
    return out.add_(torch.cat((x[..., half:], x[..., :half]), dim=-1).mul_(sin_signed))

"""Rotary position embeddings (default, linear, llama3 and yarn scaling), computed once as
tables."""

from __future__ import annotations

import math

import torch

from hetero_pd.models.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> torch.Tensor:
    params = dict(cfg.rope_params)
    if cfg.rope_type == "yarn":
        return _yarn_inverse_frequencies(params, cfg)
    dim = cfg.head_dim
    # Same formula and dtypes as transformers, so positions encode bit-identically.
    inv_freq = 1.0 / (
        cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim)
    )
    if cfg.rope_type == "linear":
        inv_freq = inv_freq / params.get("factor", 1.0)
    elif cfg.rope_type == "llama3":
        inv_freq = _llama3_scale(inv_freq, params)
    return inv_freq


def _yarn_factor(params: dict[str, float], cfg: ModelConfig) -> float:
    # No factor: DeepSeek's ratio of the context to the pretrained one (as transformers).
    old = params["original_max_position_embeddings"]
    return params.get("factor") or cfg.max_position_embeddings / old


def _yarn_inverse_frequencies(params: dict[str, float], cfg: ModelConfig) -> torch.Tensor:
    """YaRN: interpolate the low frequencies by `factor`, keep the high ones, ramp between
    (transformers' `_compute_yarn_parameters`, op for op)."""
    dim, base = cfg.head_dim, cfg.rope_theta
    factor = _yarn_factor(params, cfg)
    old = params["original_max_position_embeddings"]
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", 1.0):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    # inv_freq is 1 / pos_freqs (extrapolation); interpolation divides pos_freqs by factor.
    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    interpolation = 1.0 / (factor * pos_freqs)
    return interpolation * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def attention_factor(cfg: ModelConfig) -> float:
    """What yarn scales cos and sin by (1 for the other rope types)."""
    if cfg.rope_type != "yarn":
        return 1.0
    params = dict(cfg.rope_params)
    if "attention_factor" in params:
        return params["attention_factor"]
    factor = _yarn_factor(params, cfg)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = params.get("mscale"), params.get("mscale_all_dim")
    if m and m_all:
        return float(mscale(factor, m) / mscale(factor, m_all))
    return mscale(factor)


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
    scale = attention_factor(cfg)
    return torch.stack((emb.cos() * scale, emb.sin() * scale), dim=1)


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

"""An optional defence: Gaussian noise on the hidden states a device sends.

Each row (one position) gets noise of standard deviation `sigma` times that row's root mean
square, so one sigma means the same signal-to-noise ratio at every split layer. It makes the
inversion attacks of `edge.inversion` weaker and the cloud's output less faithful;
`hetero-pd bench edge-privacy --noise` measures both. It does not touch the KV rows that
`prompt_only` sessions send.
"""

from __future__ import annotations

import torch


def add_noise(
    hidden: torch.Tensor, sigma: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """hidden [n, d] plus N(0, (sigma * rms(row))^2) per element; sigma = 0 returns it as is."""
    if sigma < 0:
        raise ValueError(f"noise sigma must be >= 0, got {sigma}")
    if sigma == 0:
        return hidden
    rms = hidden.float().pow(2).mean(-1, keepdim=True).sqrt()
    noise = torch.randn(hidden.shape, generator=generator, dtype=torch.float32)
    return (hidden.float() + sigma * rms * noise.to(hidden.device)).to(hidden.dtype)

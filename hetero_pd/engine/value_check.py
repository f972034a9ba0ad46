"""Values from outside the engine (an edge device's hidden states and early-layer KV) are
checked where they enter: each must be finite in the dtype the engine computes and caches in.
A NaN or an infinity, or a finite value that the cast into that dtype turns into one, would
be written into the KV cache, where attention spreads it to every row that reads the slot."""

from __future__ import annotations

import torch


def check_fits(values: torch.Tensor, dtype: torch.dtype, field: str) -> None:
    """Raises ValueError naming `field` unless every one of `values` is finite in `dtype`."""
    if not values.numel():
        return
    limit = torch.finfo(dtype).max
    peak = float(values.detach().abs().amax())  # NaN when any value is NaN
    if not peak <= limit:
        name = str(dtype).removeprefix("torch.")
        raise ValueError(
            f"{field} holds NaN or values outside {name}'s finite range (|x| <= {limit:.4g}), "
            "the dtype this engine computes in"
        )

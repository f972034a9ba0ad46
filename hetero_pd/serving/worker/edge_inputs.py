"""What an edge prompt brings to a worker, decoded from its frames: the hidden states
entering the worker's first layer and, for a whole-model worker, the device's early-layer
KV. A frame that does not decode is refused naming its field; the engine then checks the
values fit its dtype (engine/value_check.py)."""

from __future__ import annotations

import torch

from hetero_pd import hidden_codec
from hetero_pd.engine.llm_engine import LLMEngine
from hetero_pd.serving.control import values as V


def edge_prompt(
    edge: V.EdgePrompt | None, engine: LLMEngine, worker_id: str
) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """An edge prompt's hidden states [num_tokens, hidden] and, for a whole-model
    worker, the device's early-layer KV [k, 2, num_tokens, kv_heads, head_dim]."""
    start = engine.config.start_layer
    if edge is None:
        if start:
            raise ValueError(
                f"worker {worker_id} runs layers [{start}, L): it takes hidden states from "
                "an edge session, not prompt token ids"
            )
        return None
    cfg = engine.model_config
    hidden = decode_frame(edge.hidden, cfg.hidden_size, "hidden")
    if start:
        if edge.early_kv is not None:
            raise ValueError(f"worker {worker_id} runs layers [{start}, L): no early KV")
        return hidden, None
    k = edge.layer
    if edge.early_kv is None or not 1 <= k < cfg.num_layers:
        raise ValueError(
            f"worker {worker_id} runs the whole model: an edge prompt needs the KV of the "
            f"device's layers (early_kv, layer in [1, {cfg.num_layers}))"
        )
    flat = decode_frame(edge.early_kv, cfg.num_kv_heads * cfg.head_dim, "early_kv")
    n = hidden.shape[0]
    if flat.shape[0] != 2 * k * n:
        raise ValueError(f"early_kv holds {flat.shape[0]} rows, not 2 x {k} x {n}")
    return hidden, flat.view(k, 2, n, cfg.num_kv_heads, cfg.head_dim)


def decode_frame(frame: V.HiddenFrame, width: int, field: str) -> torch.Tensor:
    """A frame's values (the engine checks they fit its dtype); a refusal names `field`."""
    try:
        return hidden_codec.decode(frame.as_dict(), width)
    except hidden_codec.CodecError as e:
        raise hidden_codec.CodecError(f"{field}: {e}") from None

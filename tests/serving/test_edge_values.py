"""A worker refuses an edge prompt whose decoded values its KV cache cannot hold, with an
error that names the field (the client gets a 4xx), and runs nothing for it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from edge import EdgeRuntime
from hetero_pd import SamplingParams, hidden_codec
from hetero_pd.config import EngineConfig
from hetero_pd.engine.llm_engine import LLMEngine
from hetero_pd.serving.control import protocol as P
from hetero_pd.serving.control import values as V
from hetero_pd.serving.worker.requests import RequestBook

K = 1
PARAMS = P.WireParams.of(SamplingParams(max_tokens=4))


def frames(model_dir: Path, ids: list[int]) -> tuple[dict[str, Any], torch.Tensor]:
    """The prompt's hidden-state frame, and its early KV flat as the device sends it."""
    rt = EdgeRuntime(model_dir, K)
    hidden = rt.prefill(ids)
    early = torch.stack([rt.past_k, rt.past_v], dim=1)  # [k, 2, n, kv_heads, head_dim]
    return hidden_codec.encode(hidden, "float32"), early.reshape(2 * K * len(ids), -1)


def int8_scaled(flat: torch.Tensor, scale: float) -> dict[str, Any]:
    frame = hidden_codec.encode(flat, "int8")
    frame["scale"] = np.full(flat.shape[0], scale, "<f4").tobytes()
    return frame


@pytest.mark.parametrize("poison", ["huge", "int8 scale"])
def test_edge_values_the_cache_cannot_hold_are_refused(tiny_llama_dir: Path, poison: str) -> None:
    cfg = EngineConfig.from_kwargs(
        model=str(tiny_llama_dir), num_kv_blocks=16, dtype="bfloat16", num_threads=1
    )
    engine = LLMEngine(cfg)
    sent: list[Any] = []
    book = RequestBook("w", engine, None, lambda owner, msg: sent.append(msg), 5.0)  # type: ignore[arg-type]
    ids = [1, 2, 3]
    hidden, flat = frames(tiny_llama_dir, ids)
    if poison == "huge":  # float32 on the wire, past bfloat16's largest (~3.39e38)
        flat[2, 5] = 3.4e38
        early = hidden_codec.encode(flat, "float32")
    else:  # 127 x 3e38 is past even float32's largest
        early = int8_scaled(flat, 3e38)
    edge = V.EdgePrompt(hidden=V.HiddenFrame.of(hidden), early_kv=V.HiddenFrame.of(early), layer=K)
    book.start(b"router", P.Generate(rid="r", prompt_ids=[0] * len(ids), params=PARAMS, edge=edge))
    [error] = sent
    assert isinstance(error, P.Error) and error.code is V.ErrorCode.BAD_REQUEST
    assert "early_kv" in error.message
    assert not engine.has_unfinished_requests() and not book.requests

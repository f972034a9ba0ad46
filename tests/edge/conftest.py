"""Edge fixtures: the engine's full model as the reference for the device's hidden states."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

from hetero_pd.models.attention import AttentionMetadata, PrefillSpan
from hetero_pd.models.config import ModelConfig
from hetero_pd.models.llama import CausalLM, KVCache
from hetero_pd.models.loader import load_model

CPU = torch.device("cpu")
# (model dir, prompt, decode tokens, end layer) -> hidden after layer end-1 for the prompt,
# then for each decode token: [len(prompt) + len(decode), hidden]
Reference = Callable[[Path, Sequence[int], Sequence[int], int], torch.Tensor]


def _full_model(path: Path, max_positions: int) -> CausalLM:
    return load_model(path, ModelConfig.from_dir(path), torch.float32, CPU, max_positions)


def reference_hidden(
    model: CausalLM, prompt: Sequence[int], decode: Sequence[int], end_layer: int
) -> torch.Tensor:
    """The engine's CausalLM on one sequence over a paged cache laid out slot = position."""
    cfg, total = model.cfg, len(prompt) + len(decode)
    caches: list[KVCache] = [
        (
            torch.zeros(total, 1, cfg.num_kv_heads, cfg.head_dim),
            torch.zeros(total, 1, cfg.num_kv_heads, cfg.head_dim),
        )
        for _ in range(cfg.num_layers)
    ]
    n = len(prompt)
    meta = AttentionMetadata(slot_mapping=torch.arange(n), prefills=[PrefillSpan(0, n)])
    outs = []
    with torch.inference_mode():
        ids = torch.tensor(list(prompt))
        outs.append(model(torch.arange(n), meta, caches, input_ids=ids, end_layer=end_layer))
        for pos, token in enumerate(decode, start=n):
            meta = AttentionMetadata(
                slot_mapping=torch.tensor([pos]),
                num_decode_tokens=1,
                decode_slots=torch.arange(pos + 1),
                decode_mask=torch.ones(1, 1, 1, pos + 1, dtype=torch.bool),
            )
            ids = torch.tensor([token])
            outs.append(
                model(torch.tensor([pos]), meta, caches, input_ids=ids, end_layer=end_layer)
            )
    return torch.cat(outs)


@pytest.fixture(scope="session")
def reference() -> Reference:
    models: dict[Path, CausalLM] = {}

    def run(path: Path, prompt: Sequence[int], decode: Sequence[int], end: int) -> torch.Tensor:
        if path not in models:
            models[path] = _full_model(path, 256)
        return reference_hidden(models[path], prompt, decode, end)

    return run

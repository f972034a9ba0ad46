"""A backend's fused MoE kernel (`Backend.moe_kernel`) takes the routed experts of every MoE
layer in eager steps. No backend here has one, so a recording stand-in (the grouped path
behind a counter, named as such) shows the hook is called with the layer's experts and that
what it returns is what the model uses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from backends.cpu import CpuBackend
from hetero_pd import LLM, SamplingParams
from hetero_pd.models import moe
from hetero_pd.models.config import ModelConfig

PROMPTS = [[5, 9, 200, 31, 7], [42, 300, 17]]


def _greedy(path: Path) -> list[list[int]]:
    llm = LLM(str(path), dtype="float32", compile="off", num_kv_blocks=32, block_size=8)
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    finally:
        llm.engine.close()


@pytest.mark.parametrize("fixture", ["tiny_mixtral_dir", "tiny_deepseek_v3_dir"])
def test_the_backends_moe_kernel_runs_every_moe_layer(
    fixture: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    path: Path = request.getfixturevalue(fixture)
    expected = _greedy(path)
    calls: list[tuple[int, torch.dtype]] = []

    def recording_stand_in(*args: Any) -> torch.Tensor:
        x, gate_up = args[0], args[3]
        calls.append((gate_up.shape[0], x.dtype))
        return moe.grouped_experts(*args)

    monkeypatch.setattr(CpuBackend, "moe_kernel", lambda self, dtype: recording_stand_in)
    assert _greedy(path) == expected
    cfg = ModelConfig.from_dir(path)
    assert calls and set(calls) == {(cfg.num_experts, torch.float32)}
    # Every MoE layer, every step: the calls come in whole rounds of the MoE layers.
    assert len(calls) % len(cfg.moe_layers) == 0

    def broken_stand_in(*args: Any) -> torch.Tensor:
        return torch.zeros_like(args[0])  # what the model uses is what the kernel returns

    monkeypatch.setattr(CpuBackend, "moe_kernel", lambda self, dtype: broken_stand_in)
    assert _greedy(path) != expected


def test_no_backend_here_has_a_moe_kernel() -> None:
    assert CpuBackend().moe_kernel(torch.float32) is None

"""Fixtures for the serving tests: the single-process engine as the reference."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from hetero_pd import LLM, SamplingParams


class Reference:
    """`hetero_pd.LLM` over the same model, in float32 as test stacks run (a deployment's
    default dtype): what the stack must answer, token for token."""

    def __init__(self, model: str | Path) -> None:
        self.llm = LLM(
            str(model), dtype="float32", num_kv_blocks=512, max_model_len=1024, num_threads=1
        )

    def texts(self, prompts: list[list[int]], params: SamplingParams) -> list[str]:
        return [o.outputs[0].text for o in self.llm.generate(prompts, params)]


@pytest.fixture(scope="session")
def tiny_reference(tiny_llama_dir: Path) -> Reference:
    return Reference(tiny_llama_dir)


@pytest.fixture(scope="session")
def reference_for() -> Callable[[Path], Reference]:
    """The Reference of any model folder, built once per folder."""
    cache: dict[Path, Reference] = {}

    def get(model: Path) -> Reference:
        if model not in cache:
            cache[model] = Reference(model)
        return cache[model]

    return get

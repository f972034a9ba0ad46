"""Multi-host tests need Linux network namespaces: root and iproute2 (CI has both)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from hetero_pd.deploy.netns import unavailable


@pytest.fixture(scope="session")
def netns_ok() -> None:
    """Skips (saying why) where namespaces cannot be made; CI runs as root and runs them."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture(scope="session")
def tiny_texts(tiny_llama_dir: Path) -> Callable[[list[list[int]], int], list[str]]:
    """The single-process engine's greedy texts for token-id prompts (the reference), in
    float32 as the drill's pods run (a deployment's default dtype)."""
    from hetero_pd import LLM, SamplingParams

    llm = LLM(
        str(tiny_llama_dir), dtype="float32", num_kv_blocks=512, max_model_len=1024, num_threads=1
    )

    def texts(prompts: list[list[int]], max_tokens: int) -> list[str]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return [o.outputs[0].text for o in llm.generate(prompts, params)]

    return texts

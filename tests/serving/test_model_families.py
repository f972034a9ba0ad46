"""Each model family through the real stack (router + 1 prefill + 1 decode worker process):
prompts prefilled on the decode worker and prompts whose KV crosses from the prefill worker
give the single-process engine's greedy text. The Llama family's full suite is
test_stack.py; here, the architectures whose layers differ from it: Qwen3 (dense, q/k norms),
Qwen3-MoE (mixture of experts, one dense layer) and DeepSeek-V3 (MLA: one latent KV tensor
per layer crosses between the workers, not K and V heads)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from hetero_pd import SamplingParams
from hetero_pd.deploy.testing import deployment, random_prompts, running_stack

DECISIONS = "hetero_pd_policy_decisions_total"
#: Up to 32 prompt tokens are prefilled on the decode worker (router.local_prefill_max_tokens).
LENGTHS = [5, 20, 33, 64, 120, 200]
MAX_TOKENS = 12


@pytest.mark.parametrize(
    "model_fixture", ["tiny_qwen3_dir", "tiny_qwen3_moe_dir", "tiny_deepseek_v3_dir"]
)
def test_1p1d_greedy_equals_engine(
    model_fixture: str, request: pytest.FixtureRequest, reference_for: Callable[[Path], Any]
) -> None:
    path: Path = request.getfixturevalue(model_fixture)
    prompts = random_prompts(LENGTHS, seed=28)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = reference_for(path).texts(prompts, params)

    async def run(url: str, model: str) -> list[str]:
        client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0)
        async with client:
            rs = await asyncio.gather(*(
                client.completions.create(
                    model=model, prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                    extra_body={"ignore_eos": True},
                )
                for p in prompts
            ))  # fmt: skip
        return [r.choices[0].text for r in rs]

    with running_stack(deployment(path)) as stack:
        served = asyncio.run(asyncio.wait_for(run(stack.base_url, stack.dep.model), 60))
        assert served == expected
        local = sum(n <= 32 for n in LENGTHS)
        assert stack.metric(DECISIONS, decision="local_prefill") == local
        assert stack.metric(DECISIONS, decision="disaggregated") == len(LENGTHS) - local
        assert stack.metric(DECISIONS, decision="recompute") == 0
        stack.wait_idle()

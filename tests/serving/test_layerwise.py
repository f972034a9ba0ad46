"""Layer-wise KV streaming (each layer pushed as soon as it is computed, overlapping the
rest of the forward pass) gives the same answers as the single-process engine."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import openai
import pytest

from hetero_pd import SamplingParams
from hetero_pd.deploy.testing import Stack, deployment, random_prompts, running_stack

DECISIONS = "hetero_pd_policy_decisions_total"


@pytest.mark.parametrize(
    ("model_fixture", "lengths"),
    [
        ("tiny_llama_dir", [40, 33, 64, 100, 150, 200, 257, 300, 450, 520, 700, 20]),
        # MLA: one latent tensor per layer (tensors_per_layer 1) pushed layer by layer.
        ("tiny_deepseek_v3_dir", [40, 90, 200, 20]),
        # Qwen3-MoE: q/k norms, routed experts and a dense layer between them.
        ("tiny_qwen3_moe_dir", [40, 90, 200, 20]),
        # Mixtral: every layer a mixture of experts (block_sparse_moe names, renormalised top-2).
        ("tiny_mixtral_dir", [40, 90, 200, 20]),
        # Qwen3 dense: per-head q/k norms, head_dim != hidden / heads.
        ("tiny_qwen3_dir", [40, 90, 200, 20]),
    ],
)
def test_layerwise_streaming_equals_engine(
    model_fixture: str,
    lengths: list[int],
    request: pytest.FixtureRequest,
    reference_for: Callable[[Path], Any],
) -> None:
    model: Path = request.getfixturevalue(model_fixture)
    dep = deployment(model, transfer={"layerwise": True, "transports": ["shm"]})
    prompts = random_prompts(lengths, seed=81)
    max_tokens = [6 + i % 9 for i in range(len(prompts))]
    expected = reference_for(model).texts(
        prompts,
        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens],
    )
    with running_stack(dep) as stack:

        async def run() -> list[str]:
            client = openai.AsyncOpenAI(base_url=stack.base_url, api_key="x", max_retries=0)
            async with client:
                rs = await asyncio.gather(*(
                    client.completions.create(
                        model=stack.dep.model, prompt=p, max_tokens=n, temperature=0,
                        extra_body={"ignore_eos": True},
                    )
                    for p, n in zip(prompts, max_tokens, strict=True)
                ))  # fmt: skip
            return [r.choices[0].text for r in rs]

        assert asyncio.run(asyncio.wait_for(run(), 60)) == expected
        assert stack.metric(DECISIONS, decision="disaggregated") == len(lengths) - 1
        assert stack.metric(DECISIONS, decision="recompute") == 0
        stack.wait_idle()
        # Layer by layer: one push per layer (3) for every disaggregated prompt.
        pushes = 3 * (len(lengths) - 1)
        sent = wait_counter(stack, "prefill-0", "shm", "transfers_done_total", pushes)
        assert sent["shm"]["transfers_failed_total"] == 0


def wait_counter(
    stack: Stack, worker: str, transport: str, name: str, value: int, timeout_s: float = 10.0
) -> dict[str, Any]:
    """A worker's transfer metrics (from its heartbeats) once `name` reached `value`."""
    assert stack.router is not None
    deadline = time.monotonic() + timeout_s
    while True:
        load = stack.router.workers[worker].load
        metrics = {t: msgspec.structs.asdict(c) for t, c in load.transfer.items()}
        got = metrics.get(transport, {}).get(name, 0)
        if got >= value:
            assert got == value, f"{worker}: {name} = {got}, expected {value}"
            return metrics
        assert time.monotonic() < deadline, f"{worker}: {name} stayed at {got} < {value}"
        time.sleep(0.05)

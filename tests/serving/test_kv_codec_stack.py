"""A served 1P1D deployment with `transfer.kv_codec: int8` over TCP: the decode worker
decodes on int8-carried KV and still answers with transformers' greedy tokens."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

from hetero_pd.deploy.testing import Stack, deployment, random_prompts, running_stack
from hetero_pd.sampling_params import SamplingParams


async def _tokens(stack: Stack, rid: str, prompt: list[int]) -> list[int]:
    assert stack.router is not None
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    async with contextlib.aclosing(stack.router.generate(rid, prompt, params)) as stream:
        return [t async for msg in stream for t in msg.token_ids]


def test_int8_kv_over_tcp_serves_transformers_tokens(
    tiny_llama_dir: Path, hf_greedy: Callable[..., list[int]]
) -> None:
    dep = deployment(tiny_llama_dir, transfer={"kv_codec": "int8", "transports": ["tcp"]})
    assert dep.transfer.kv_codec == "int8"
    prompts = random_prompts([70, 90], seed=13)  # longer than local_prefill_max_tokens
    with running_stack(dep) as stack:
        for i, prompt in enumerate(prompts):
            got = stack.call(_tokens(stack, f"int8-{i}", prompt), timeout_s=120)
            assert got == hf_greedy(tiny_llama_dir, prompt, 6)
        # the prompts were prefilled on the prefill worker and their KV crossed (TCP only)
        assert stack.metric("hetero_pd_kv_transfer_bytes_total", transport="kv") > 0

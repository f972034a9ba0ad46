"""KV resharded in transit (issue 29, step 3): a prefill worker at one tensor-parallel size
hands its prompts' KV to a decode worker at another, in both directions, and the answers
are the single-process engine's greedy text. A TP worker's region holds every KV head
(engine/tp/kv.py), so each hand-off moves exactly the prompt's blocks, as at TP 1."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from hetero_pd import SamplingParams
from hetero_pd.config import parse_dtype
from hetero_pd.deploy.testing import deployment, random_prompts, running_stack
from hetero_pd.models.config import ModelConfig

BYTES = "hetero_pd_kv_transfer_bytes_total"
DECISIONS = "hetero_pd_policy_decisions_total"
#: Longer than router.local_prefill_max_tokens (32): each goes through the prefill worker.
LENGTHS = [40, 75, 130]
MAX_TOKENS = 10


@pytest.mark.parametrize(
    ("model_fixture", "prefill_tp", "decode_tp", "transfer"),
    [
        # Layer by layer from TP 2: rank 0 pushes layer l once its all-reduces are done, by
        # which time rank 1 has written its heads of layer l.
        pytest.param(
            "tiny_qwen3_dir", 2, 1, {"transports": ["tcp"], "layerwise": True},
            id="tp2-to-tp1-tcp-layers",
        ),
        # shm: the prefill worker writes into the files decode's two ranks map.
        pytest.param(
            "tiny_qwen3_dir", 1, 2, {"transports": ["shm"]}, id="tp1-to-tp2-shm-whole"
        ),
        # MLA: both prefill ranks write the same whole latent; decode's two ranks read it.
        pytest.param(
            "tiny_deepseek_v3_dir", 2, 1, {"transports": ["shm"], "layerwise": True},
            id="mla-tp2-to-tp1-shm-layers",
        ),
        pytest.param(
            "tiny_deepseek_v3_dir", 1, 2, {"transports": ["tcp"]}, id="mla-tp1-to-tp2-tcp-whole"
        ),
    ],
)  # fmt: skip
def test_prefill_and_decode_at_different_tp(
    model_fixture: str,
    prefill_tp: int,
    decode_tp: int,
    transfer: dict[str, Any],
    request: pytest.FixtureRequest,
    reference_for: Callable[[Path], Any],
) -> None:
    model: Path = request.getfixturevalue(model_fixture)
    prompts = random_prompts(LENGTHS, seed=29)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = reference_for(model).texts(prompts, params)
    dep = deployment(
        model,
        workers=[
            {"role": "prefill", "tensor_parallel_size": prefill_tp},
            {"role": "decode", "tensor_parallel_size": decode_tp},
        ],
        transfer=transfer,
    )
    cfg = ModelConfig.from_dir(model)
    elem = torch.tensor([], dtype=parse_dtype(dep.dtype)).element_size()
    with running_stack(dep) as stack:
        assert stack.router is not None
        bs = stack.router.workers["decode-0"].info.block_size
        client = openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0, timeout=60)
        for prompt, want in zip(prompts, expected, strict=True):
            before = stack.metric(BYTES, transport="kv")
            r = client.completions.create(
                model=dep.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert r.choices[0].text == want
            moved = stack.metric(BYTES, transport="kv") - before
            assert moved == -(-len(prompt) // bs) * bs * cfg.kv_bytes_per_token * elem
        assert stack.metric(DECISIONS, decision="disaggregated") == len(LENGTHS)
        assert stack.metric(DECISIONS, decision="recompute") == 0
        stack.wait_idle()

"""KV resharded in transit (issue 29, step 3): a prefill worker at one tensor-parallel size
hands its prompts' KV to a decode worker at another, in both directions, and the answers
are the single-process engine's greedy text. A TP worker's region holds every KV head
(engine/tp/kv.py), so each hand-off moves exactly the prompt's blocks in the writes a TP 1
worker makes: a chunk per run of blocks of one layer's K or V (or latent), not a write per
head slice per block."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from hetero_pd import SamplingParams
from hetero_pd.config import parse_dtype
from hetero_pd.deploy.testing import Stack, deployment, random_prompts, running_stack
from hetero_pd.models.config import ModelConfig
from transfer import TransferConfig, layout

BYTES = "hetero_pd_kv_transfer_bytes_total"
DECISIONS = "hetero_pd_policy_decisions_total"
#: Longer than router.local_prefill_max_tokens (32): each goes through the prefill worker.
LENGTHS = [40, 75, 130]
MAX_TOKENS = 10


# A covering set, not the cross product (3 families x 2 directions x {layers, whole} x {tcp,
# shm} = 24 stacks at ~20 s each): these 6 take every pair of values of any two of those
# four axes at least once (pairwise), so each direction runs layer by layer and whole, each
# family both ways and over both transports.
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
        # MoE: experts sharded across the ranks, the KV heads split as in a dense model.
        pytest.param(
            "tiny_mixtral_dir", 2, 1, {"transports": ["tcp"]}, id="moe-tp2-to-tp1-tcp-whole"
        ),
        pytest.param(
            "tiny_mixtral_dir", 1, 2, {"transports": ["shm"], "layerwise": True},
            id="moe-tp1-to-tp2-shm-layers",
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
        (transport,) = transfer["transports"]
        writes = 0
        for prompt, want in zip(prompts, expected, strict=True):
            before = stack.metric(BYTES, transport="kv")
            r = client.completions.create(
                model=dep.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            assert r.choices[0].text == want
            moved = stack.metric(BYTES, transport="kv") - before
            assert moved == -(-len(prompt) // bs) * bs * cfg.kv_bytes_per_token * elem
            # As many writes as a TP 1 worker's whole-head region needs for these blocks
            # (one chunk plan per push, however the pushes are cut into layers), not one
            # per head slice per block.
            block_bytes = math.prod(cfg.kv_block_shape(bs)) * elem
            writes += tp1_writes(cfg, -(-len(prompt) // bs), block_bytes)
            assert prefill_counter(stack, transport, "chunks_sent_total", writes) == writes
        assert stack.metric(DECISIONS, decision="disaggregated") == len(LENGTHS)
        assert stack.metric(DECISIONS, decision="recompute") == 0
        stack.wait_idle()


def tp1_writes(cfg: ModelConfig, num_blocks: int, block_bytes: int) -> int:
    """Writes (chunks) of a push of `num_blocks` blocks from a TP 1 worker's region, one
    layer at a time or all at once (the same chunks: a chunk never spans tensors)."""
    per_chunk = layout.blocks_per_chunk(block_bytes, TransferConfig().chunk_bytes, num_blocks)
    tensors = range(cfg.num_layers * cfg.kv_tensors_per_layer)
    return len(layout.plan(tensors, num_blocks, per_chunk))


def prefill_counter(stack: Stack, transport: str, name: str, at_least: int) -> int:
    """prefill-0's transfer counter `name` once its heartbeats report `at_least` (a request
    answered has had all its KV sent, so the next heartbeat has counted it)."""
    assert stack.router is not None
    deadline = time.monotonic() + 10
    while True:
        counters = stack.router.workers["prefill-0"].load.transfer.get(transport)
        got = 0 if counters is None else int(getattr(counters, name))
        if got >= at_least:
            return got
        assert time.monotonic() < deadline, f"prefill-0 {transport} {name}: {got} < {at_least}"
        time.sleep(0.05)


def test_bench_tp_handoff_reports_writes_and_rate(
    tiny_qwen3_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`hetero-pd bench tp --handoff` at toy sizes: TP 2 -> 1 makes the writes of TP 1 -> 1,
    each request's KV in one chunk per layer's K and V (3 blocks of 16 tokens per tensor)."""
    from hetero_pd.bench.tp import main

    args = [str(tiny_qwen3_dir), "--no-timing", "--handoff", "--requests", "2"]
    assert main([*args, "--prompt-tokens", "40", "--transport", "shm"]) == 0
    (row,) = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    kv, cfg = row["kv_handoff"], ModelConfig.from_dir(tiny_qwen3_dir)
    assert (kv["transport"], kv["requests"], kv["prompt_tokens"]) == ("shm", 2, 40)
    want = tp1_writes(cfg, 3, math.prod(cfg.kv_block_shape(16)) * 4)
    assert want == cfg.num_layers * 2
    for side in ("tp1_to_tp1", "tp2_to_tp1"):
        assert kv[side]["writes_per_request"] == want
        assert kv[side]["kv_bytes_per_request"] == 3 * 16 * cfg.kv_bytes_per_token * 4
        assert kv[side]["bytes_per_s"] > 0
    assert kv["writes_ratio"] == 1.0

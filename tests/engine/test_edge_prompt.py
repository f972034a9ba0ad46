"""Edge prompts in a whole-model engine ("prompt only" mode): the device ran layers [0, k) on
the prompt and sent the hidden states entering layer k plus those layers' KV; the engine runs
layers [k, L) on the prompt and decodes alone. Greedy tokens equal the unsplit engine's, in
batches mixed with ordinary requests and with chunked prefill."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edge import EdgeRuntime
from hetero_pd import LLM, SamplingParams
from hetero_pd.config import EngineConfig
from hetero_pd.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def device_side(model_dir: Path, k: int, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    rt = EdgeRuntime(model_dir, k)
    hidden = rt.prefill(ids)
    return hidden, torch.stack([rt.past_k, rt.past_v], dim=1)


def run(engine: LLMEngine) -> dict[str, list[int]]:
    done: dict[str, list[int]] = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


@pytest.mark.parametrize(("k", "budget"), [(1, 512), (2, 7)])
def test_edge_prompts_decode_like_the_unsplit_engine(
    tiny_llama_dir: Path, k: int, budget: int
) -> None:
    prompts = [[(5 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((19, 4, 33))]
    cfg = EngineConfig.from_kwargs(
        model=str(tiny_llama_dir), num_kv_blocks=128, max_num_batched_tokens=budget, num_threads=1
    )
    engine = LLMEngine(cfg)
    for i, ids in enumerate(prompts):
        hidden, early = device_side(tiny_llama_dir, k, ids)
        engine.add_edge_prompt_request(hidden, early, GREEDY, f"edge-{i}")
        engine.add_request(ids, GREEDY, f"plain-{i}")  # the same prompt, the ordinary way
    done = run(engine)
    want = [
        o.outputs[0].token_ids
        for o in LLM(str(tiny_llama_dir), num_threads=1).generate(prompts, GREEDY)
    ]
    assert [done[f"edge-{i}"] for i in range(3)] == want
    assert [done[f"plain-{i}"] for i in range(3)] == want
    engine.check_integrity()
    assert engine.kv.num_used_blocks == 0


def test_bad_edge_prompts_are_refused(tiny_llama_dir: Path) -> None:
    engine = LLMEngine(EngineConfig.from_kwargs(model=str(tiny_llama_dir), num_kv_blocks=32))
    hidden, early = device_side(tiny_llama_dir, 1, [1, 2, 3])
    with pytest.raises(ValueError, match="early-layer KV must be"):
        engine.add_edge_prompt_request(hidden, early[:, :, :2], GREEDY, "short-kv")
    with pytest.raises(ValueError, match="hidden states must be"):
        engine.add_edge_prompt_request(hidden[:, :8], early, GREEDY, "narrow")
    assert not engine.has_unfinished_requests()

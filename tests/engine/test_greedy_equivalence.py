"""Greedy tokens equal transformers' `generate` (float32): mixed lengths in one batch,
chunked prefill forcing splits, prefix-cache hits and preemption."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from hetero_pd import LLM, SamplingParams

#: Every architecture family, as its tiny random-weight fixture (tests/conftest.py).
TINY_MODELS = (
    "tiny_llama_dir",
    "tiny_qwen2_dir",
    "tiny_qwen3_dir",
    "tiny_mixtral_dir",
    "tiny_qwen3_moe_dir",
    "tiny_deepseek_v3_dir",
)

Ref = Callable[[Path, list[int], int], list[int]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def random_prompts(lengths: list[int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def assert_matches(llm: LLM, path: Path, prompts: list[list[int]], hf_greedy: Ref) -> None:
    outs = llm.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(path, prompt, GREEDY.max_tokens)
    llm.engine.check_integrity()
    assert llm.engine.kv.num_used_blocks == 0, "blocks still in use after all finished"


@pytest.mark.parametrize("model_fixture", TINY_MODELS)
def test_mixed_lengths_with_chunked_prefill(
    model_fixture: str, request: pytest.FixtureRequest, hf_greedy: Ref
) -> None:
    path = request.getfixturevalue(model_fixture)
    # A 40-token budget splits the long prompts into chunks that share steps with decodes.
    llm = LLM(
        str(path), dtype="float32", max_num_batched_tokens=40, block_size=8, num_kv_blocks=128
    )
    prompts = random_prompts([3, 17, 90, 1, 41, 64, 8], 512, seed=1)
    assert_matches(llm, path, prompts, hf_greedy)


def test_prefix_cache_hits(tiny_llama_dir: Path, hf_greedy: Ref) -> None:
    llm = LLM(str(tiny_llama_dir), dtype="float32", block_size=8, num_kv_blocks=128)
    shared = random_prompts([40], 512, seed=2)[0]
    first = [[*shared, 5, 6, 7]]
    assert_matches(llm, tiny_llama_dir, first, hf_greedy)
    prompts = [shared + tail for tail in random_prompts([3, 12, 1], 512, seed=3)] + [shared]
    outs = llm.generate(prompts, GREEDY)
    assert [o.num_cached_tokens for o in outs] == [40, 40, 40, 32]
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(tiny_llama_dir, prompt, GREEDY.max_tokens)
    llm.engine.check_integrity()


def test_preemption_by_recompute(tiny_llama_dir: Path, hf_greedy: Ref) -> None:
    # 24 blocks of 4 tokens cannot hold six requests of ~40 tokens at once.
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        block_size=4,
        num_kv_blocks=24,
        enable_prefix_caching=False,
    )
    prompts = random_prompts([9, 14, 20, 5, 11, 16], 512, seed=4)
    reqs = [llm.engine.add_request(p, GREEDY) for p in prompts]
    outs = {}
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step():
            if out.finished:
                outs[out.request_id] = out
    assert sum(r.num_preemptions for r in reqs) > 0, "the test did not force a preemption"
    for prompt, req in zip(prompts, reqs, strict=True):
        got = outs[req.request_id].outputs[0].token_ids
        assert got == hf_greedy(tiny_llama_dir, prompt, GREEDY.max_tokens)
    llm.engine.check_integrity()


def test_default_model_matches_transformers(default_model_dir: Path, hf_greedy: Ref) -> None:
    llm = LLM("smollm2-135m-instruct", dtype="float32", max_num_batched_tokens=64, num_kv_blocks=64)
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a land far away, there lived a wise old owl who",
        "List three colors:",
    ]
    prompts = [llm.tokenizer.encode(t) for t in texts]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(default_model_dir, prompt, 32)
    llm.engine.check_integrity()

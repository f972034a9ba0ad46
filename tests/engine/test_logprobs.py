"""Logprobs of generated and prompt tokens against transformers' own log-softmax (float32),
through chunked prefill, prefix-cache hits, mixed batches and temperature."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from hetero_pd import LLM, SamplingParams
from hetero_pd.outputs import Logprob

TOL = 1e-4
TOP = 5


@pytest.fixture(scope="module")
def hf_logprobs(tiny_llama_dir: Path) -> Callable[[list[int]], torch.Tensor]:
    """[len(ids), vocab] log-softmax of transformers' model: row p predicts token p + 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    return run


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    # A 16-token budget splits every longer prompt into chunks.
    return LLM(
        str(tiny_llama_dir),
        dtype="float32",
        num_kv_blocks=128,
        block_size=8,
        max_num_batched_tokens=16,
    )


def prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 512) for _ in range(n)] for n in lengths]


def assert_entry(entry: dict[int, Logprob], token: int, ref: torch.Tensor, top: int) -> None:
    """One position: the chosen token first with its logprob and rank, then the top ones."""
    tokens = list(entry)
    assert tokens[0] == token
    assert abs(entry[token].logprob - ref[token].item()) < TOL
    assert entry[token].rank == int((ref >= ref[token] - 1e-6).sum())
    values, ids = ref.topk(top)
    expected = [t for t in ids.tolist() if t != token]
    assert tokens[1:] == expected[: len(tokens) - 1]
    for rank, (t, v) in enumerate(zip(ids.tolist(), values.tolist(), strict=True), 1):
        if t in entry:
            assert abs(entry[t].logprob - v) < TOL
            if t != token:
                assert entry[t].rank == rank
    assert len(entry) in (top, top + 1)


def test_output_and_prompt_logprobs_match_transformers(llm: LLM, hf_logprobs: Any) -> None:
    batch = prompts([3, 37, 20, 1], seed=1)
    params = SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, logprobs=TOP, prompt_logprobs=TOP
    )
    for prompt, out in zip(batch, llm.generate(batch, params), strict=True):
        c = out.outputs[0]
        ref = hf_logprobs(prompt + c.token_ids)
        assert out.prompt_logprobs is not None and c.logprobs is not None
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        for pos in range(1, len(prompt)):
            entry = out.prompt_logprobs[pos]
            assert entry is not None
            assert_entry(entry, prompt[pos], ref[pos - 1], TOP)
        assert len(c.logprobs) == len(c.token_ids)
        for i, (token, entry) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
            assert_entry(entry, token, ref[len(prompt) - 1 + i], TOP)
            assert entry[token].rank == 1, "greedy picks the most likely token"
        total = sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs, strict=True))
        assert c.cumulative_logprob is not None and abs(c.cumulative_logprob - total) < 1e-6
        assert all(
            e[t].decoded_token == llm.tokenizer.decode([t])
            for t, e in zip(c.token_ids, c.logprobs, strict=True)
        )
    llm.engine.check_integrity()


def test_logprobs_zero_is_the_chosen_token_only_and_none_when_not_asked(llm: LLM) -> None:
    (prompt,) = prompts([9], seed=2)
    (out,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, logprobs=0))
    assert out.outputs[0].logprobs is not None
    assert [list(e) for e in out.outputs[0].logprobs] == [[t] for t in out.outputs[0].token_ids]
    assert out.prompt_logprobs is None
    (plain,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3))
    assert plain.outputs[0].logprobs is None and plain.outputs[0].cumulative_logprob is None


def test_prompt_logprobs_are_complete_after_a_prefix_cache_hit(llm: LLM, hf_logprobs: Any) -> None:
    (prompt,) = prompts([40], seed=3)
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1))  # caches its blocks
    (hit,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1))
    assert hit.num_cached_tokens == 32, "the prefix cache serves the plain request"
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2)
    (out,) = llm.generate(prompt, params)
    assert out.num_cached_tokens == 0, "a prompt-logprobs request computes every position"
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
    ref = hf_logprobs(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert entry is not None
        assert_entry(entry, prompt[pos], ref[pos - 1], 2)


def test_sampled_logprobs_are_after_the_temperature(llm: LLM, hf_logprobs: Any) -> None:
    (prompt,) = prompts([12], seed=4)
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=5, ignore_eos=True, logprobs=3)
    (out,) = llm.generate(prompt, params)
    c = out.outputs[0]
    assert c.logprobs is not None
    full = prompt + c.token_ids
    from transformers import AutoModelForCausalLM  # the raw logits, divided by 0.7

    model = AutoModelForCausalLM.from_pretrained(llm.engine.model_path, dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([full])).logits[0].float()
    ref = torch.log_softmax(logits / 0.7, dim=-1)
    for i, (token, entry) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
        assert_entry(entry, token, ref[len(prompt) - 1 + i], 3)
    raw = hf_logprobs(full)
    differs = max(
        abs(e[t].logprob - raw[len(prompt) - 1 + i, t].item())
        for i, (t, e) in enumerate(zip(c.token_ids, c.logprobs, strict=True))
    )
    assert differs > 1e-3, "temperature 0.7 must change the reported logprobs"

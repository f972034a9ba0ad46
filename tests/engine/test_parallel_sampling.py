"""n > 1: n completions per prompt, seeded like vLLM (seed + index), sharing the prompt's
full KV blocks through the prefix cache."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from hetero_pd import LLM, SamplingParams
from hetero_pd.engine.request import Request


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), num_kv_blocks=128, block_size=8)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 512) for _ in range(n)]


def test_n_completions_equal_separate_requests_seeded_by_index(llm: LLM) -> None:
    ids = prompt(11, 1)
    params = SamplingParams(n=3, temperature=1.0, seed=40, max_tokens=8, ignore_eos=True)
    (out,) = llm.generate(ids, params)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert out.finished and out.prompt_token_ids == ids
    singles = [
        llm.generate(
            ids, SamplingParams(temperature=1.0, seed=40 + i, max_tokens=8, ignore_eos=True)
        )[0]
        for i in range(3)
    ]
    assert [c.token_ids for c in out.outputs] == [s.outputs[0].token_ids for s in singles]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3, "different seeds, different text"
    again = llm.generate(ids, params)[0]
    assert [c.text for c in again.outputs] == [c.text for c in out.outputs]


def test_children_share_the_prompt_blocks(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    added: list[Request] = []
    add = llm.engine.add_request

    def recording(*args: Any, **kwargs: Any) -> Request:
        req = add(*args, **kwargs)
        added.append(req)
        return req

    monkeypatch.setattr(llm.engine, "add_request", recording)
    ids = prompt(30, 2)  # 3 full blocks of 8 + 6 tokens
    params = SamplingParams(n=4, temperature=0.9, seed=1, max_tokens=4, logprobs=1)
    (out,) = llm.generate(ids, params)
    ids_ = [out.request_id] + [f"{i}_{out.request_id}" for i in range(1, 4)]
    assert [r.request_id for r in added] == ids_
    assert [r.num_cached_tokens for r in added] == [0, 24, 24, 24]
    assert all(c.logprobs is not None and len(c.logprobs) == 4 for c in out.outputs)
    llm.engine.check_integrity()
    assert llm.engine.kv.num_used_blocks == 0, "every block is free again"


def test_greedy_n_and_prompt_logprobs_from_the_first_completion(llm: LLM) -> None:
    ids = prompt(9, 3)
    params = SamplingParams(n=2, temperature=0, max_tokens=5, prompt_logprobs=1)
    (out,) = llm.generate([ids, ids], params)[:1]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(ids)


def test_a_seed_at_the_top_of_the_range_wraps() -> None:
    p = SamplingParams(n=3, seed=2**64 - 2)
    assert [p.for_completion(i).seed for i in range(3)] == [2**64 - 2, 2**64 - 1, 0]
    assert p.for_completion(1).n == 1


def test_the_engine_itself_takes_one_completion(llm: LLM) -> None:
    with pytest.raises(ValueError, match="an engine request is one completion"):
        llm.engine.add_request(prompt(3, 0), SamplingParams(n=2))
    assert not llm.engine.has_unfinished_requests()

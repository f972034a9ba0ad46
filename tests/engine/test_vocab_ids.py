"""A token id outside the vocabulary in a request's parameters is refused when the request is
added; it never indexes the logits (stop_token_ids [1000000] with min_tokens used to raise
inside engine.step, which ends a worker process)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from hetero_pd import LLM, SamplingParams
from hetero_pd.engine.sampler import Sampler


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), num_kv_blocks=64, block_size=8)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 512) for _ in range(n)]


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(stop_token_ids=[1_000_000], min_tokens=1, max_tokens=2), "stop_token_ids"),
        (SamplingParams(logit_bias={512: 1.0}), "logit_bias keys"),
    ],
)
def test_out_of_vocabulary_ids_are_refused_and_the_engine_goes_on(
    llm: LLM, params: SamplingParams, field: str
) -> None:
    with pytest.raises(ValueError, match=rf"{field} \[\d+\] are outside the vocabulary"):
        llm.generate(prompt(4, 0), params)
    assert not llm.engine.has_unfinished_requests()
    (out,) = llm.generate(prompt(4, 0), SamplingParams(temperature=0, max_tokens=2, min_tokens=1))
    assert len(out.outputs[0].token_ids) == 2
    llm.engine.check_integrity()


def test_an_id_outside_the_vocabulary_past_admission_is_an_error_not_an_index() -> None:
    """Only a bug can carry one past admission: the sampler names it (and the engine fails
    that request alone) rather than indexing the logits with it."""
    logits = torch.zeros(1, 8)
    with pytest.raises(ValueError, match=r"suppressed token ids \[1000000\] are outside"):
        Sampler()(logits, [SamplingParams(temperature=0)], [None], [[3, 1_000_000]])

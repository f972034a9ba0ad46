"""Penalties and logit_bias as OpenAI and transformers define them, seeded and deterministic;
token ids outside the vocabulary never reach the logits."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from hetero_pd import LLM, SamplingParams
from hetero_pd.engine.logits_processors import process_logits
from hetero_pd.engine.sampler import Sampler


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=128, block_size=8)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    return model


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 512) for _ in range(n)]


def test_frequency_and_presence_follow_openai_formula() -> None:
    """mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence, with c
    counting the generated tokens only (the prompt does not count)."""
    logits = torch.randn(2, 10, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(frequency_penalty=0.5, presence_penalty=1.5),
        SamplingParams(),  # no penalty: the row keeps its exact values
    ]
    histories = [([1, 1, 9], [2, 2, 2, 3]), ([1], [2])]
    out = process_logits(logits, params, None, histories)
    expected = logits[0].clone()
    expected[2] -= 3 * 0.5 + 1.5
    expected[3] -= 1 * 0.5 + 1.5
    assert torch.allclose(out[0], expected, atol=1e-6)
    assert torch.equal(out[1], logits[1])


def test_biases_and_penalties_on_bf16_logits_are_computed_in_float32() -> None:
    """Logits come in the model's dtype: a bias or penalty is added to their float32 copy
    (exact), not rounded back to bf16, so a bf16 model's row gets what a float32 row of the
    same values gets."""
    logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    params = [SamplingParams(logit_bias={5: 0.01}), SamplingParams(frequency_penalty=0.013)]
    histories = [([1], [2]), ([1], [7, 7])]
    out = process_logits(logits, params, None, histories)
    assert out.dtype == torch.float32
    assert torch.equal(out, process_logits(logits.float(), params, None, histories))
    assert out[0, 5] == logits[0, 5].float() + 0.01  # 0.01 would vanish in bf16 near 1
    plain = [SamplingParams(), SamplingParams()]
    assert process_logits(logits, plain, [[3], []], histories).dtype == torch.bfloat16


def test_repetition_penalty_divides_positive_and_multiplies_negative() -> None:
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0]])
    out = process_logits(logits, [SamplingParams(repetition_penalty=2.0)], None, [([0], [1])])
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0, 1.0]]  # prompt and output tokens both count


def test_logit_bias_is_added_before_sampling() -> None:
    logits = torch.zeros(1, 6)
    params = [SamplingParams(logit_bias={"4": 100, 1: -100.0}, temperature=0)]
    out = process_logits(logits, params)
    assert out.tolist() == [[0.0, -100.0, 0.0, 0.0, 100.0, 0.0]]
    assert Sampler()(logits, params, [None]) == [4]


def test_greedy_repetition_penalty_equals_transformers_generate(
    llm: LLM, hf_model: torch.nn.Module
) -> None:
    for seed in range(3):
        ids = prompt(10, seed)
        params = SamplingParams(
            temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.8
        )
        (out,) = llm.generate(ids, params)
        with torch.inference_mode():
            ref = hf_model.generate(
                torch.tensor([ids]),
                max_new_tokens=16,
                do_sample=False,
                repetition_penalty=1.8,
                pad_token_id=0,
            )
        assert out.outputs[0].token_ids == ref[0, len(ids) :].tolist()


def test_greedy_frequency_and_presence_equal_a_reference_loop(
    llm: LLM, hf_model: torch.nn.Module
) -> None:
    """transformers' logits, OpenAI's formula applied by hand, argmax: the same tokens."""
    ids = prompt(6, 7)
    freq, pres = 1.2, 0.7
    out: list[int] = []
    for _ in range(12):
        with torch.inference_mode():
            logits = hf_model(torch.tensor([ids + out])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=512).float()
        logits = logits - counts * freq - (counts > 0).float() * pres
        out.append(int(logits.argmax()))
    params = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, frequency_penalty=freq, presence_penalty=pres
    )
    (got,) = llm.generate(ids, params)
    assert got.outputs[0].token_ids == out
    (plain,) = llm.generate(ids, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert plain.outputs[0].token_ids != out, "the penalties must change this output"


def test_seeded_penalized_sampling_is_deterministic(llm: LLM) -> None:
    params = SamplingParams(
        temperature=1.0,
        seed=11,
        max_tokens=20,
        ignore_eos=True,
        presence_penalty=2.0,
        frequency_penalty=-0.5,
        repetition_penalty=1.3,
        logit_bias={5: 3.0},
    )
    batch = [prompt(8, 1), prompt(8, 2)]
    first = [o.outputs[0].token_ids for o in llm.generate(batch, params)]
    again = [o.outputs[0].token_ids for o in llm.generate(batch[::-1], params)][::-1]
    assert first == again, "a seeded request does not depend on the batch around it"


def test_logit_bias_can_force_and_ban_tokens(llm: LLM) -> None:
    ids = prompt(5, 3)
    forced = SamplingParams(temperature=0.8, seed=1, max_tokens=6, logit_bias={42: 100})
    assert llm.generate(ids, forced)[0].outputs[0].token_ids == [42] * 6
    greedy = SamplingParams(temperature=0, max_tokens=1)
    top = llm.generate(ids, greedy)[0].outputs[0].token_ids[0]
    banned = SamplingParams(temperature=0, max_tokens=1, logit_bias={top: -100})
    assert llm.generate(ids, banned)[0].outputs[0].token_ids[0] != top

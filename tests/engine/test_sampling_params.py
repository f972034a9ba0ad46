"""SamplingParams: defaults, normalization and validation messages."""

from __future__ import annotations

from typing import Any

import pytest

from hetero_pd.sampling_params import SamplingParams


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (
        1,
        16,
        1.0,
        1.0,
        0,
        0.0,
    )
    assert p.seed is None and p.stop == [] and p.stop_token_ids == []
    assert not p.ignore_eos and p.min_tokens == 0
    assert p.skip_special_tokens and not p.include_stop_str_in_output
    assert not p.greedy


def test_normalization() -> None:
    p = SamplingParams(stop="###", stop_token_ids=(7, 8), top_k=-1, temperature=0, top_p=1)
    assert p.stop == ["###"]
    assert p.stop_token_ids == [7, 8]
    assert p.top_k == 0
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert SamplingParams(stop=["a", "bc"]).stop == ["a", "bc"]
    assert SamplingParams(max_tokens=None).max_tokens is None


@pytest.mark.parametrize(
    ("temperature", "greedy"), [(0.0, True), (1e-6, True), (1e-5, False), (0.7, False)]
)
def test_greedy(temperature: float, greedy: bool) -> None:
    assert SamplingParams(temperature=temperature).greedy is greedy


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be an integer in [1, 128], got 0"),
        ({"n": 2.0}, "n must be an integer in [1, 128], got 2.0"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
        ({"frequency_penalty": "x"}, "frequency_penalty must be a finite number, got 'x'"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0, got 0.0"),
        ({"logit_bias": {"a": 1}}, "logit_bias keys must be token ids (integers >= 0), got 'a'"),
        ({"logit_bias": {"-3": 1}}, "logit_bias keys must be token ids (integers >= 0), got '-3'"),
        ({"logit_bias": {5: 101}}, "logit_bias[5] must be in [-100, 100], got 101"),
        ({"logit_bias": [1]}, "logit_bias must be a map of token id to bias or None, got [1]"),
        ({"logprobs": 21}, "logprobs must be an integer in [0, 20] or None, got 21"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be an integer in [0, 20] or None, got -1"),
        ({"max_tokens": 0}, "max_tokens must be an integer >= 1 or None, got 0"),
        ({"max_tokens": 2.5}, "max_tokens must be an integer >= 1 or None, got 2.5"),
        ({"temperature": -1.0}, "temperature must be >= 0, got -1.0"),
        ({"temperature": float("nan")}, "temperature must be a finite number, got nan"),
        ({"temperature": "hot"}, "temperature must be a finite number, got 'hot'"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_k": -2}, "top_k must be an integer >= 1, or 0 or -1 to disable it, got -2"),
        ({"top_k": 1.0}, "top_k must be an integer >= 1, or 0 or -1 to disable it, got 1.0"),
        ({"min_p": 1.1}, "min_p must be in [0, 1], got 1.1"),
        ({"seed": 2**64}, "seed must be an integer in [-2**63, 2**64) or None, got 18446744073"),
        ({"seed": "1"}, "seed must be an integer in [-2**63, 2**64) or None, got '1'"),
        ({"stop": ""}, "stop must contain only non-empty strings, got ''"),
        ({"stop": ["a", 3]}, "stop must contain only non-empty strings, got 3"),
        ({"stop": 3}, "stop must be a string, a list of strings or None, got 3"),
        ({"stop_token_ids": [1, -1]}, "stop_token_ids must contain only integers >= 0, got -1"),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list of integers or None, got 5"),
        ({"ignore_eos": 1}, "ignore_eos must be true or false, got 1"),
        ({"skip_special_tokens": None}, "skip_special_tokens must be true or false, got None"),
        ({"min_tokens": -1}, "min_tokens must be an integer >= 0, got -1"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be <= max_tokens (4), got 5"),
    ],
)
def test_validation_messages(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert str(info.value).startswith(message)


def test_accepts_edge_values() -> None:
    p = SamplingParams(top_p=1e-9, min_p=1.0, seed=-(2**63), min_tokens=16, max_tokens=16)
    assert p.seed == -(2**63)
    assert SamplingParams(seed=2**64 - 1, min_tokens=100, max_tokens=None).min_tokens == 100

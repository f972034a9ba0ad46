"""Workloads: lengths, proportions, JSONL parsing and its error messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetero_pd.bench.datasets import (
    MixedSpec,
    TokenizerText,
    WordText,
    jsonl_requests,
    mixed_requests,
    random_requests,
)


def test_random_word_prompts_have_the_asked_length() -> None:
    reqs = random_requests(20, 32, 16, WordText(), seed=1)
    assert [r.prompt_len for r in reqs] == [32] * 20
    assert {r.max_tokens for r in reqs} == {16}
    assert all(len(r.prompt.split()) == 32 for r in reqs)
    assert reqs == random_requests(20, 32, 16, WordText(), seed=1)
    assert len({r.prompt for r in reqs}) == 20


def test_random_range_ratio_bounds() -> None:
    reqs = random_requests(200, 100, 10, WordText(), range_ratio=0.5, seed=2)
    assert min(r.prompt_len for r in reqs) >= 50 and max(r.prompt_len for r in reqs) <= 150
    assert min(r.max_tokens for r in reqs) >= 5 and max(r.max_tokens for r in reqs) <= 15
    assert len({r.prompt_len for r in reqs}) > 20
    with pytest.raises(ValueError, match="range-ratio"):
        random_requests(1, 10, 10, WordText(), range_ratio=1.0)


def test_random_with_a_real_tokenizer(tokenizer_dir: Path) -> None:
    source = TokenizerText(tokenizer_dir)
    reqs = random_requests(8, 64, 8, source, seed=3)
    for r in reqs:
        assert abs(r.prompt_len - 64) <= 4
        assert r.prompt_len == source.count(r.prompt)
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        TokenizerText(tokenizer_dir / "missing")


def test_mixed_proportions_and_lengths() -> None:
    spec = MixedSpec(long_fraction=0.25, short_input_len=20, short_output_len=30,
                     long_input_len=300, long_output_len=10)  # fmt: skip
    reqs = mixed_requests(40, spec, WordText(), seed=4)
    long = [r for r in reqs if r.prompt.startswith("Summarize")]
    short = [r for r in reqs if r.prompt.startswith("Question")]
    assert (len(long), len(short)) == (10, 30)
    assert all(r.max_tokens == 10 and abs(r.prompt_len - 300) <= 2 for r in long)
    assert all(r.max_tokens == 30 and abs(r.prompt_len - 20) <= 2 for r in short)
    assert [r.prompt.startswith("Summarize") for r in reqs[:10]] != [True] * 10


def test_jsonl_file(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    rows = [{"prompt": "one two three", "max_tokens": 5}, {"prompt": "four"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    reqs = jsonl_requests(path, WordText(), default_max_tokens=9)
    assert [(r.prompt, r.prompt_len, r.max_tokens) for r in reqs] == [
        ("one two three", 3, 5),
        ("four", 1, 9),
    ]
    assert [r.prompt for r in jsonl_requests(path, WordText(), 9, n=5)] == [
        "one two three", "four", "one two three", "four", "one two three"
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "w.jsonl:2: not JSON"),
        ('{"text": "x"}', 'w.jsonl:2: expected an object with a string "prompt"'),
        ('{"prompt": "x", "max_tokens": 0}', 'w.jsonl:2: "max_tokens" must be'),
        ('{"prompt": "x", "temperature": 1}', "w.jsonl:2: unknown keys"),
    ],
)
def test_jsonl_errors_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ValueError) as info:
        jsonl_requests(path, WordText(), 4)
    assert message in str(info.value)

"""Benchmark workloads: random prompts, a chat + summarization mix, a JSONL file or ShareGPT.

Prompt lengths are in tokens.  With a tokenizer (``--tokenizer PATH``: a Hugging Face
folder or its ``tokenizer.json``) prompts are random token ids decoded to text and lengths
are exact up to re-tokenization; without one, prompts are common English words that are one
token each in typical BPE vocabularies, and lengths are word counts (an approximation).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

# Each is a single token (with its leading space) in Llama/SmolLM2/Qwen-style BPE vocabularies.
_WORD_TEXT = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there one all we their has been if more when "
    "will would who so no time year people way day man thing woman life child world school "
    "state family group country problem hand part place case week company system program "
    "question work government number night point home water room mother area money story "
    "fact month lot right study book eye job word business issue side kind head house "
    "service friend father power hour game line end member law car city name team minute"
)
WORDS = tuple(_WORD_TEXT.split())


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One prompt to send: its text, its length in tokens and how many tokens to ask for."""

    prompt: str
    prompt_len: int
    max_tokens: int


class TextSource(Protocol):
    """Makes prompt text of a given token length and counts tokens of any text."""

    def text(self, num_tokens: int, rng: np.random.Generator) -> str: ...

    def count(self, text: str) -> int: ...


class WordText:
    """Random common words; one word is counted as one token."""

    def text(self, num_tokens: int, rng: np.random.Generator) -> str:
        idx = rng.integers(0, len(WORDS), size=num_tokens)
        return " ".join(WORDS[i] for i in idx)

    def count(self, text: str) -> int:
        return len(text.split())


class TokenizerText:
    """Random token ids of a real tokenizer, decoded; counts are the tokenizer's own."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        p = Path(path)
        file = p / "tokenizer.json" if p.is_dir() else p
        if not file.is_file():
            raise FileNotFoundError(f"--tokenizer: no tokenizer.json at {p}")
        self._tok = Tokenizer.from_file(str(file))
        special = set(self._tok.get_added_tokens_decoder())
        self._ids = np.array(
            [i for i in range(self._tok.get_vocab_size()) if i not in special], dtype=np.int64
        )

    def _encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def text(self, num_tokens: int, rng: np.random.Generator) -> str:
        ids = rng.choice(self._ids, size=num_tokens).tolist()
        # Decoding then re-encoding can merge or split tokens; trim to the target length.
        return str(self._tok.decode(self._encode(self._tok.decode(ids))[:num_tokens]))

    def count(self, text: str) -> int:
        return len(self._encode(text))


def _lengths(rng: np.random.Generator, n: int, mean: int, range_ratio: float) -> list[int]:
    lo = max(1, round(mean * (1 - range_ratio)))
    hi = max(lo, round(mean * (1 + range_ratio)))
    return [int(v) for v in rng.integers(lo, hi + 1, size=n)]


def random_requests(
    n: int,
    input_len: int,
    output_len: int,
    source: TextSource,
    range_ratio: float = 0.0,
    seed: int = 0,
) -> list[BenchRequest]:
    """``n`` prompts of random text; lengths uniform in ``len * [1 - ratio, 1 + ratio]``."""
    if input_len < 1 or output_len < 1:
        raise ValueError("--random-input-len and --random-output-len must be >= 1")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    ins = _lengths(rng, n, input_len, range_ratio)
    outs = _lengths(rng, n, output_len, range_ratio)
    reqs = []
    for i, o in zip(ins, outs, strict=True):
        text = source.text(i, rng)
        reqs.append(BenchRequest(text, source.count(text), o))
    return reqs


@dataclass(frozen=True, slots=True)
class MixedSpec:
    """Short chat-like turns plus long summarization-like prompts."""

    long_fraction: float = 0.2
    short_input_len: int = 64
    short_output_len: int = 128
    long_input_len: int = 1024
    long_output_len: int = 64


def mixed_requests(
    n: int, spec: MixedSpec, source: TextSource, seed: int = 0
) -> list[BenchRequest]:
    """``round(n * long_fraction)`` long prompts and the rest short ones, shuffled."""
    if not 0 <= spec.long_fraction <= 1:
        raise ValueError(f"--mixed-long-fraction must be in [0, 1], got {spec.long_fraction}")
    rng = np.random.default_rng(seed)
    num_long = round(n * spec.long_fraction)
    kinds = np.array([True] * num_long + [False] * (n - num_long))
    rng.shuffle(kinds)
    reqs = []
    for is_long in kinds:
        if is_long:
            head = "Summarize the following text in three sentences.\n\n"
            body_len = max(1, spec.long_input_len - source.count(head))
            prompt, max_tokens = head + source.text(body_len, rng), spec.long_output_len
        else:
            head = "Question: "
            body_len = max(1, spec.short_input_len - source.count(head))
            prompt, max_tokens = head + source.text(body_len, rng) + "?", spec.short_output_len
        reqs.append(BenchRequest(prompt, source.count(prompt), max_tokens))
    return reqs


def jsonl_requests(
    path: str | Path, source: TextSource, default_max_tokens: int, n: int | None = None
) -> list[BenchRequest]:
    """Lines of ``{"prompt": str, "max_tokens": int}`` (max_tokens optional), cycled to n."""
    reqs: list[BenchRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f'{where}: expected an object with a string "prompt"')
            unknown = set(row) - {"prompt", "max_tokens"}
            if unknown:
                raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
            max_tokens = row.get("max_tokens", default_max_tokens)
            if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
                raise ValueError(f'{where}: "max_tokens" must be an integer >= 1')
            reqs.append(BenchRequest(row["prompt"], source.count(row["prompt"]), max_tokens))
    if not reqs:
        raise ValueError(f"{path}: no prompts")
    if n is None:
        return reqs
    return [reqs[i % len(reqs)] for i in range(n)]


# vLLM's ShareGPT filter (`is_valid_sequence`): lengths in tokens.
SHAREGPT_MIN_LEN = 4
SHAREGPT_MAX_PROMPT_LEN = 1024
SHAREGPT_MAX_TOTAL_LEN = 2048


def sharegpt_requests(
    path: str | Path,
    source: TextSource,
    n: int,
    output_len: int | None = None,
    seed: int = 0,
) -> list[BenchRequest]:
    """ShareGPT-format JSON as `vllm bench serve --dataset-name sharegpt` samples it.

    The file is a list of ``{"conversations": [{"from": ..., "value": ...}, ...]}``; each
    entry with two or more turns gives (first turn = prompt, second turn = the reference
    answer, whose token count is ``max_tokens`` unless ``output_len`` fixes it). Entries
    are shuffled with Python's ``random`` seeded by ``seed``; pairs with a prompt or answer
    under 4 tokens, a prompt over 1024 or a total over 2048 are skipped; the first ``n``
    kept are used (cycled when fewer are kept)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, list):
        raise ValueError(f'{path}: expected a ShareGPT list of {{"conversations": [...]}}')
    pairs = []
    for i, entry in enumerate(data):
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        texts = [t.get("value") if isinstance(t, dict) else None for t in turns[:2]]
        if not all(isinstance(t, str) for t in texts):
            raise ValueError(f'{path}: entry {i}: each turn needs a string "value"')
        pairs.append((str(texts[0]), str(texts[1])))
    random.Random(seed).shuffle(pairs)
    reqs: list[BenchRequest] = []
    for prompt, answer in pairs:
        prompt_len = source.count(prompt)
        max_tokens = output_len or source.count(answer)
        if prompt_len < SHAREGPT_MIN_LEN or prompt_len > SHAREGPT_MAX_PROMPT_LEN:
            continue
        if (output_len is None and max_tokens < SHAREGPT_MIN_LEN) or (
            prompt_len + max_tokens > SHAREGPT_MAX_TOTAL_LEN
        ):
            continue
        reqs.append(BenchRequest(prompt, prompt_len, max_tokens))
        if len(reqs) == n:
            break
    if not reqs:
        raise ValueError(f"{path}: no conversation has a usable first prompt and answer")
    return [reqs[i % len(reqs)] for i in range(n)]

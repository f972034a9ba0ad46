"""Speculative decoding with a draft model (`draft_model`) in the engine: greedy and seeded
output equal to the plain engine's with an early-exit draft (the target's first layers,
partly accepted), a random one (nearly all rejected) and the default model as its own
draft (nearly all accepted while its KV keeps in step with the target's sequence); the
draft's proposals are its own greedy continuation of the sequence as the target kept it
(its KV rolled back past rejected proposals); a draft of another vocabulary is a named
error."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from hetero_pd.engine.spec.config import SpeculativeConfig
from hetero_pd.llm import LLM
from hetero_pd.models.draft_models import save_early_exit, save_random_draft
from hetero_pd.outputs import RequestOutput
from hetero_pd.sampling_params import SamplingParams

K = 3
PROMPTS: list[list[int]] = [
    [5, 6, 7, 8, 9] * 5,
    list(range(100, 131)),
    [40, 41, 42] * 7 + [43],
    list(range(200, 209)),
]


@pytest.fixture(scope="module")
def early_exit_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_early_exit(tiny_llama_dir, tmp_path_factory.mktemp("early-exit"), 2)


@pytest.fixture(scope="module")
def random_draft_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_draft(tiny_llama_dir, tmp_path_factory.mktemp("random-draft"))


def _llm(path: Path, draft: Path | None = None, **kwargs: object) -> LLM:
    options: dict[str, object] = {"block_size": 4, "num_kv_blocks": 96, **kwargs}
    if draft is not None:
        spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K}
        options["speculative_config"] = spec
    return LLM(str(path), dtype="float32", **options)


@pytest.fixture(scope="module")
def plain(tiny_llama_dir: Path) -> LLM:
    return _llm(tiny_llama_dir)


@pytest.fixture(scope="module")
def early(tiny_llama_dir: Path, early_exit_dir: Path) -> LLM:
    return _llm(tiny_llama_dir, early_exit_dir)


def _tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _stats(llm: LLM) -> tuple[int, int]:
    assert llm.engine.speculator is not None
    s = llm.engine.speculator.stats
    return s.num_draft_tokens, s.num_accepted_tokens


def test_greedy_output_is_the_plain_one_with_either_draft(
    plain: LLM, early: LLM, tiny_llama_dir: Path, random_draft_dir: Path
) -> None:
    params = [SamplingParams(max_tokens=n, temperature=0) for n in (30, 17, 25, 9)]
    want = _tokens(plain.generate(PROMPTS, params))
    for llm in (early, _llm(tiny_llama_dir, random_draft_dir)):
        before = _stats(llm)
        assert _tokens(llm.generate(PROMPTS, params)) == want
        llm.engine.check_integrity()  # rejected proposals' target blocks all given back
        drafted, accepted = (a - b for a, b in zip(_stats(llm), before, strict=True))
        assert drafted > 20
        if llm is early:  # partly right: runs accepted and proposals rejected
            assert 0 < accepted < drafted


@pytest.mark.slow
def test_the_default_model_as_its_own_draft_is_nearly_always_accepted(
    default_model_dir: Path,
) -> None:
    """The draft is the target, so only a draft whose KV or positions drift from the
    target's sequence (stale KV after a step, an off-by-one) proposes what the target rejects."""
    prompts = ["Name three colors.", "Write a haiku about the sea."]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    options = {"block_size": 16, "num_kv_blocks": 32, "max_model_len": 256}
    want = _tokens(_llm(default_model_dir, **options).generate(prompts, params))
    llm = _llm(default_model_dir, default_model_dir, **options)
    assert _tokens(llm.generate(prompts, params)) == want
    llm.engine.check_integrity()
    drafted, accepted = _stats(llm)
    assert drafted >= 2 * K * 3  # several verified runs of K per prompt
    assert accepted >= 0.95 * drafted


def test_seeded_sampling_is_the_plain_one(plain: LLM, early: LLM) -> None:
    params = [
        SamplingParams(max_tokens=20, temperature=0.05, top_p=0.9, seed=s, min_tokens=5)
        for s in range(3)
    ] + [SamplingParams(max_tokens=20, temperature=0.05, seed=9, presence_penalty=0.01)]
    assert _tokens(early.generate(PROMPTS, params)) == _tokens(plain.generate(PROMPTS, params))


def test_proposals_are_the_drafts_greedy_continuation_after_rollbacks(
    early: LLM, early_exit_dir: Path, hf_greedy: Callable[..., list[int]]
) -> None:
    """Over a long generation whose proposals are partly rejected, each step's proposals
    are what transformers' greedy generate of the draft gives for the tokens the target
    kept: stale KV of a rejected proposal would change them."""
    engine, speculator = early.engine, early.engine.speculator
    assert speculator is not None
    seen: list[tuple[list[int], list[int]]] = []
    propose = speculator.propose

    def recording(running: list) -> None:  # type: ignore[type-arg]
        propose(running)
        seen.extend((list(r.all_token_ids), list(r.spec_token_ids)) for r in running)

    speculator.propose = recording  # type: ignore[method-assign]
    try:
        before = _stats(early)
        engine.add_request(PROMPTS[1], SamplingParams(max_tokens=80, temperature=0), "long")
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        del speculator.propose
    drafted, accepted = (a - b for a, b in zip(_stats(early), before, strict=True))
    assert 0 < accepted < drafted  # rejected proposals, so rolled-back draft KV
    checked = 0
    for tokens, proposal in seen:
        if proposal:
            assert hf_greedy(early_exit_dir, tokens, len(proposal)) == proposal
            checked += 1
    assert checked >= 5


def test_a_draft_of_another_vocabulary_is_named(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import TINY, _save_tiny

    other = _save_tiny(
        LlamaConfig(**{**TINY, "vocab_size": 256}),
        LlamaForCausalLM,
        tmp_path_factory.mktemp("v256"),
        tokenizer_dir,
        3,
    )
    with pytest.raises(ValueError, match=r"vocab_size 256 \(target: 512\)") as e:
        _llm(tiny_llama_dir, other)
    assert str(other) in str(e.value) and str(tiny_llama_dir) in str(e.value)
    with pytest.raises(ValueError, match="model names the draft model"):
        SpeculativeConfig.parse({"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="model names the draft model"):
        SpeculativeConfig.parse({"num_speculative_tokens": 2, "model": str(other)})

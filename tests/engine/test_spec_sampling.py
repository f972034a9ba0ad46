"""Speculative sampling keeps the target distribution: on a tiny random model with an
8-token vocabulary, thousands of samples of the 2nd and 3rd output tokens drawn with ngram
proposals (about two thirds accepted) follow the exact distribution transformers computes
(chi-square), as plain ones do, and so do samples drawn with a draft model's proposals.
Accepting 30% of rejected proposals anyway fails it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetero_pd.llm import LLM
from hetero_pd.sampling_params import SamplingParams

VOCAB = 8
SAMPLES = 4000
TEMPERATURE, TOP_K = 0.9, 6
# chi-square with 63 degrees of freedom exceeds this with probability 1e-4
CHI2_LIMIT = 115.0
PROMPT = [3, 4, 5, 3, 4, 5, 3]


@pytest.fixture(scope="module")
def tiny_vocab_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import TINY, _save_tiny

    config = LlamaConfig(**{**TINY, "vocab_size": VOCAB}, tie_word_embeddings=False)
    path = _save_tiny(config, LlamaForCausalLM, tmp_path_factory.mktemp("v8"), tokenizer_dir, 5)
    model = LlamaForCausalLM.from_pretrained(path)
    with torch.no_grad():  # peaked distributions, not near-uniform ones
        model.lm_head.weight.mul_(60)
    model.save_pretrained(path)
    return path


def _probs(logits: torch.Tensor) -> torch.Tensor:
    """What the sampler draws from: temperature, then top-k."""
    x = logits.double() / TEMPERATURE
    kth = x.topk(TOP_K, dim=-1).values[..., -1:]
    return torch.softmax(x.masked_fill(x < kth, float("-inf")), dim=-1)


def _exact(path: Path, prompt: list[int]) -> torch.Tensor:
    """[VOCAB, VOCAB]: the probability of each second and third output token (the first,
    sampled by the prefill step, summed out)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    with torch.no_grad():
        first = _probs(model(torch.tensor([prompt])).logits[0, -1])  # [a]
        rows = torch.tensor([[*prompt, a] for a in range(VOCAB)])
        second = _probs(model(rows).logits[:, -1])  # [a, b]
        rows = torch.tensor([[*prompt, a, b] for a in range(VOCAB) for b in range(VOCAB)])
        third = _probs(model(rows).logits[:, -1]).view(VOCAB, VOCAB, VOCAB)  # [a, b, c]
    return (first[:, None, None] * second[:, :, None] * third).sum(dim=0)


def _chi2(pairs: list[tuple[int, int]], p: torch.Tensor) -> float:
    counts = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for a, b in pairs:
        counts[a, b] += 1
    expected = p * len(pairs)
    cells = expected > 0
    assert counts[~cells].sum() == 0, "a token outside top-k was sampled"
    return float(((counts[cells] - expected[cells]) ** 2 / expected[cells]).sum())


NGRAM = {"num_speculative_tokens": 2, "prompt_lookup_min": 1}


def _sample(
    path: Path, prompt: list[int], spec: dict[str, object] | None
) -> tuple[list[tuple[int, int]], LLM]:
    options = {"speculative_config": spec} if spec else {}
    llm = LLM(str(path), dtype="float32", max_num_seqs=512, **options)
    params = SamplingParams(max_tokens=3, temperature=TEMPERATURE, top_k=TOP_K, ignore_eos=True)
    torch.manual_seed(0)
    outs = llm.generate([prompt] * SAMPLES, params)
    return [tuple(o.outputs[0].token_ids[1:]) for o in outs], llm  # type: ignore[misc]


@pytest.fixture(scope="module")
def exact(tiny_vocab_dir: Path) -> torch.Tensor:
    p = _exact(tiny_vocab_dir, PROMPT)
    plain, _ = _sample(tiny_vocab_dir, PROMPT, None)
    assert _chi2(plain, p) < CHI2_LIMIT
    return p


def _check(path: Path, spec: dict[str, object], p: torch.Tensor) -> None:
    pairs, llm = _sample(path, PROMPT, spec)
    stats = llm.engine.speculator.stats  # type: ignore[union-attr]
    assert stats.num_drafts > 0.5 * SAMPLES
    assert 0.2 * stats.num_drafts < stats.num_accepted_tokens < 0.8 * stats.num_drafts
    assert _chi2(pairs, p) < CHI2_LIMIT


def test_sampled_pairs_follow_the_target_distribution(
    tiny_vocab_dir: Path, exact: torch.Tensor
) -> None:
    _check(tiny_vocab_dir, NGRAM, exact)


def test_with_a_draft_model_too(tiny_vocab_dir: Path, exact: torch.Tensor, tmp_path: Path) -> None:
    """The draft (the target's first layer, early exit) proposes its greedy tokens."""
    from hetero_pd.models.draft_models import save_early_exit

    draft = save_early_exit(tiny_vocab_dir, tmp_path, 1)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
    _check(tiny_vocab_dir, spec, exact)

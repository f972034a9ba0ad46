"""Sampler: greedy, masks, temperature, seeds and suppressed tokens."""

from __future__ import annotations

import math

import pytest
import torch

from hetero_pd.engine.sampler import Sampler, apply_min_p, apply_top_k_top_p
from hetero_pd.sampling_params import SamplingParams

NEG_INF = float("-inf")
GREEDY = SamplingParams(temperature=0.0)


def _log(probs: list[float]) -> list[float]:
    return [math.log(p) for p in probs]


def test_greedy_is_argmax_including_ties_and_low_precision() -> None:
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(0))
    logits[0, 10] = logits[0, 20] = 100.0  # tie: first index wins, as in torch.argmax
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = logits.to(dtype)
        tokens = Sampler()(x, [GREEDY] * 6, [None] * 6)
        assert tokens == x.argmax(dim=-1).tolist()
        assert tokens[0] == 10
        assert all(isinstance(t, int) for t in tokens)


def test_greedy_over_a_wide_bf16_row_takes_the_first_of_tied_maxima() -> None:
    """The engine hands the sampler logits in the model's dtype (bf16: 49,152 columns for the
    default model); the pick must be the float32 copy's argmax, ties to the first index."""
    logits = torch.randn(64, 49152, generator=torch.Generator().manual_seed(2)).bfloat16()
    logits[0, 100] = logits[0, 40000] = logits[0, 49151] = 50.0
    logits[1, 49151] = logits[1, 30000] = 50.0
    tokens = Sampler()(logits, [GREEDY] * 64, [None] * 64)
    assert tokens == logits.float().argmax(dim=-1).tolist()
    assert tokens[:2] == [100, 30000]


def test_greedy_rows_in_a_mixed_batch_stay_argmax() -> None:
    logits = torch.randn(4, 500, generator=torch.Generator().manual_seed(1))
    params = [GREEDY, SamplingParams(top_k=5), GREEDY, SamplingParams(temperature=2.0)]
    with torch.inference_mode():
        tokens = Sampler()(logits, params, [None] * 4)
    argmax = logits.argmax(dim=-1).tolist()
    assert (tokens[0], tokens[2]) == (argmax[0], argmax[2])
    assert tokens[1] in logits[1].topk(5).indices.tolist()


def test_top_k_keeps_k_largest_and_ties() -> None:
    logits = torch.tensor([[3.0, 1.0, 5.0, 4.0, 2.0], [1.0, 2.0, 2.0, 0.0, 3.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2, 2]), torch.tensor([1.0, 1.0]))
    assert out.tolist() == [
        [NEG_INF, NEG_INF, 5.0, 4.0, NEG_INF],
        [NEG_INF, 2.0, 2.0, NEG_INF, 3.0],  # both tokens tied at the k-th value are kept
    ]


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    probs = [0.15, 0.5, 0.05, 0.3]  # sorted: 0.5, 0.3, 0.15, 0.05
    logits = torch.tensor([_log(probs)] * 4)
    top_p = torch.tensor([0.1, 0.6, 0.9, 1.0])
    out = apply_top_k_top_p(logits, torch.zeros(4, dtype=torch.long), top_p)
    kept = (out > NEG_INF).tolist()
    assert kept[0] == [False, True, False, False]  # the top token is always kept
    assert kept[1] == [False, True, False, True]  # 0.5 < 0.6 -> needs 0.3 too
    assert kept[2] == [True, True, False, True]  # 0.8 < 0.9 -> needs 0.15 too
    assert kept[3] == [True, True, True, True]  # 1.0 disables top-p
    assert torch.equal(out[1, [1, 3]], logits[1, [1, 3]])  # kept logits are untouched


def test_top_p_applies_after_top_k() -> None:
    logits = torch.tensor([_log([0.5, 0.3, 0.15, 0.05])] * 2)
    # Alone, top_p=0.82 needs 0.5+0.3+0.15; after top_k=3 renormalizes (/0.95) two reach it.
    out = apply_top_k_top_p(logits, torch.tensor([0, 3]), torch.tensor([0.82, 0.82]))
    assert (out > NEG_INF).tolist() == [[True, True, True, False], [True, True, False, False]]


def test_disabled_rows_unchanged_and_k_above_vocab() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    out = apply_top_k_top_p(logits, torch.tensor([0, -1, 500]), torch.ones(3))
    assert torch.equal(out, logits)


def _reference_kept(row: list[float], k: int, p: float) -> set[int]:
    """Top-k (ties kept) then top-p, written the obvious way in float64."""
    order = sorted(range(len(row)), key=lambda i: -row[i])
    if 0 < k < len(row):
        order = [i for i in order if row[i] >= row[order[k - 1]]]
    if p >= 1.0:
        return set(order)
    weights = torch.tensor([row[i] for i in order], dtype=torch.float64).softmax(-1).tolist()
    kept, mass = set(), 0.0
    for i, w in zip(order, weights, strict=True):
        if mass >= p:
            break
        kept.add(i)
        mass += w
    return kept


ROWS_WINDOWED = ([1, 7, 100, 0, 0, 0, 40, 3], [1.0, 1.0, 1.0, 0.3, 0.9, 0.99, 0.5, 0.95])
ROWS_FULL_SORT = ([0, 5, 2999, 0], [1.0, 0.9, 1.0, 0.8])  # an unmasked row needs every token


@pytest.mark.parametrize("rows", [ROWS_WINDOWED, ROWS_FULL_SORT])
@pytest.mark.parametrize("scale", [0.05, 1.0, 4.0])  # flat rows: the nucleus leaves the window
def test_masks_match_reference_on_random_rows(
    scale: float, rows: tuple[list[int], list[float]]
) -> None:
    top_k, top_p = rows
    gen = torch.Generator().manual_seed(int(scale * 100))
    logits = torch.randn(len(top_k), 3000, generator=gen) * scale
    logits[:2] = logits[:2].to(torch.bfloat16).float()  # exact ties for top-k rows
    _assert_matches_reference(logits, top_k, top_p)


def test_top_k_ties_beyond_the_window() -> None:
    logits = torch.randint(0, 10, (3, 3000), generator=torch.Generator().manual_seed(5)).float()
    _assert_matches_reference(logits, [5, 1, 20], [1.0, 1.0, 1.0])


def _assert_matches_reference(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> None:
    out = apply_top_k_top_p(logits, torch.tensor(top_k), torch.tensor(top_p))
    for r in range(len(top_k)):
        kept = set((out[r] > NEG_INF).nonzero().flatten().tolist())
        assert kept == _reference_kept(logits[r].tolist(), top_k[r], top_p[r]), r
        assert torch.equal(out[r, list(kept)], logits[r, list(kept)])


def test_min_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]])
    out = apply_min_p(probs, torch.tensor([0.2, 0.0]))
    assert out.tolist()[0] == pytest.approx([0.5, 0.3, 0.15, 0.0])
    assert torch.equal(out[1], probs[1])


def _frequencies(tokens: list[int], vocab: int) -> list[float]:
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab)
    return (counts / len(tokens)).tolist()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 3.0])
def test_frequencies_follow_softmax_of_logits_over_temperature(temperature: float) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    rows = 4000
    with torch.random.fork_rng():
        torch.manual_seed(1234)
        params = [SamplingParams(temperature=temperature)] * rows
        tokens = Sampler()(logits.expand(rows, -1), params, [None] * rows)
    expected = (logits / temperature).softmax(-1).tolist()
    assert _frequencies(tokens, 5) == pytest.approx(expected, abs=0.03)


def test_seeded_frequencies_follow_masked_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    params = [SamplingParams(top_k=3, seed=7)]
    gen = torch.Generator().manual_seed(7)
    tokens = [Sampler()(logits, params, [gen])[0] for _ in range(3000)]
    expected = [*logits[0, :3].softmax(-1).tolist(), 0.0, 0.0]
    assert _frequencies(tokens, 5) == pytest.approx(expected, abs=0.03)


def _run_seeded(
    batch: list[tuple[SamplingParams, torch.Generator | None]], steps: int
) -> list[list[int]]:
    """Token sequences of every row over `steps` steps, with fixed per-row logits."""
    vocab = 3000
    logits = torch.randn(len(batch), vocab, generator=torch.Generator().manual_seed(3))
    logits[0] = torch.randn(vocab, generator=torch.Generator().manual_seed(4)) * 3
    params = [p for p, _ in batch]
    gens = [g for _, g in batch]
    out = [Sampler()(logits, params, gens) for _ in range(steps)]
    return [[step[i] for step in out] for i in range(len(batch))]


def test_seeded_row_independent_of_batch_composition() -> None:
    def seeded() -> tuple[SamplingParams, torch.Generator]:
        return SamplingParams(temperature=0.8, top_p=0.95, seed=42), torch.Generator().manual_seed(
            42
        )

    alone = _run_seeded([seeded()], steps=10)[0]
    others: list[tuple[SamplingParams, torch.Generator | None]] = [
        (SamplingParams(), None),
        (GREEDY, None),
        (SamplingParams(top_k=3, min_p=0.1, seed=1), torch.Generator().manual_seed(1)),
        (SamplingParams(temperature=0.3), None),
        (SamplingParams(top_p=0.99), None),  # a flat row: forces the full sort on the group
    ]
    crowded = _run_seeded([seeded(), *others], steps=10)[0]
    assert crowded == alone
    assert len(set(alone)) > 1  # it really samples
    assert _run_seeded([seeded()], steps=10)[0] == alone
    other_seed = (SamplingParams(temperature=0.8, top_p=0.95), torch.Generator().manual_seed(43))
    assert _run_seeded([other_seed], steps=10)[0] != alone


def test_suppressed_tokens_are_never_picked() -> None:
    logits = torch.tensor([[0.0, 10.0, 9.0, -5.0]] * 3)
    params = [GREEDY, SamplingParams(temperature=5.0), SamplingParams()]
    suppress = [[1], [1, 2], []]
    with torch.random.fork_rng():
        torch.manual_seed(0)
        picks = [Sampler()(logits, params, [None] * 3, suppress) for _ in range(200)]
    assert all(p[0] == 2 for p in picks)
    assert all(p[1] in (0, 3) for p in picks)
    assert logits[0, 1] == 10.0  # the caller's logits are not modified


def test_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="one SamplingParams and one generator per logits row"):
        Sampler()(torch.zeros(2, 4), [GREEDY], [None, None])

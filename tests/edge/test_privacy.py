"""Inversion attacks on what a split sends, on a tiny random model: they recover every token
where the rows are the embeddings (so they are real), fail on rows that carry nothing (so
they can fail), and the privacy bench's JSON line and stored profile parse."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from edge.inversion import (
    apply_linear,
    capture,
    fit_linear,
    fit_mlp,
    nearest,
    score,
    standardize_like,
    token_tables,
    value_table,
)
from edge.loader import load_edge_stack
from edge.noise import add_noise
from edge.privacy import PrivacyProfile, PrivacyProfileError
from hetero_pd.bench import edge_privacy

PROMPTS = [[3, 141, 59, 265, 358, 97, 93, 238, 462, 64, 33], [279, 7, 400, 12, 5, 77, 301]]


def _train(n: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 512, (length,), generator=gen).tolist() for _ in range(n)]


def test_attacks_recover_embeddings_and_fail_on_noise(tiny_llama_dir: Path) -> None:
    stack = load_edge_stack(tiny_llama_dir, 2, torch.float32, torch.device("cpu"), 64)
    ev = capture(stack, PROMPTS, [0, 1, 2], [0, 1])
    train = capture(stack, _train(16, 32), [0, 1, 2], [0, 1])
    vocab = torch.arange(512)
    embed = stack.embed_tokens.weight.detach()
    tables = token_tables(stack, vocab, [0, 1, 2])
    assert torch.equal(tables[0], embed)
    # k = 0: the rows are the embeddings; every attack recovers every token.
    assert score(nearest(ev.hidden[0], tables[0], vocab), ev.ids).top1 == 1.0
    w = fit_linear(train.hidden[0], embed[train.ids])
    assert (
        score(nearest(apply_linear(w, ev.hidden[0], train.hidden[0]), embed, vocab), ev.ids).top1
        == 1.0
    )
    net = fit_mlp(train.hidden[0], embed[train.ids], width=64, steps=150)
    with torch.no_grad():
        pred = net(standardize_like(ev.hidden[0], train.hidden[0]))
    assert score(nearest(pred, embed, vocab), ev.ids).top1 >= 0.9
    # Layer 0's V rows depend on the token alone: the exact table inverts them.
    assert score(nearest(ev.values[0], value_table(stack, vocab), vocab), ev.ids).top1 == 1.0
    # Rows that carry nothing about the tokens: the attacks fail.
    blind = torch.randn(ev.hidden[1].shape, generator=torch.Generator().manual_seed(0))
    assert score(nearest(blind, tables[1], vocab), ev.ids).top5 < 0.2
    # Heavy noise on the sent rows defeats the table attack at k = 0.
    noisy = add_noise(ev.hidden[0], 20.0, torch.Generator().manual_seed(0))
    assert score(nearest(noisy, tables[0], vocab), ev.ids).top1 < 0.5


def test_token_table_matches_a_one_token_sequence(tiny_llama_dir: Path) -> None:
    stack = load_edge_stack(tiny_llama_dir, 2, torch.float32, torch.device("cpu"), 64)
    tables = token_tables(stack, torch.tensor([5, 300]), [2])
    for row, token in zip(tables[2], (5, 300), strict=True):
        alone = capture(stack, [[token]], [2], [])
        torch.testing.assert_close(row, alone.hidden[2][0], rtol=1e-4, atol=1e-5)


def test_noise_rejects_negative_sigma() -> None:
    with pytest.raises(ValueError, match="sigma"):
        add_noise(torch.ones(2, 4), -1.0)
    rows = torch.ones(2, 4)
    assert add_noise(rows, 0.0) is rows


def test_bench_json_and_profile(
    text_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "privacy.json"
    argv = ["--model", str(text_llama_dir), "--splits", "0,1", "--train-tokens", "128"]
    argv += ["--seq-len", "64", "--nn-candidates", "512", "--noise", "0.5", "--threads", "1"]
    assert edge_privacy.main([*argv, "--profile-out", str(out)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["splits"] == [0, 1] and result["train_positions"] == 128
    rows = {(r["k"], r["codec"], r["noise_sigma"]): r for r in result["rows"]}
    assert set(rows) == {
        (k, c, s) for k in (0, 1) for c, s in (("float16", 0.0), ("int8", 0.0), ("float16", 0.5))
    }
    # k = 0 sends the embeddings: the nearest-neighbour attack reads every token back.
    assert rows[0, "float16", 0.0]["nn_top1"] == 1.0
    assert rows[0, "float16", 0.0]["agreement_pct"] is None
    clean = rows[1, "float16", 0.0]
    assert clean["kv_v0_top1"] == 1.0 and clean["agreement_pct"] == 100.0
    for r in result["rows"]:
        assert all(
            0.0 <= r[key] <= r[key.replace("top1", "top5")] <= 1.0
            for key in r
            if key.endswith("_top1")
        )
    profile = PrivacyProfile.load(out)
    assert profile.top1[0] == 1.0 and set(profile.top1) == {0, 1}
    assert profile.top1[1] == pytest.approx(result["recovery_top1"]["1"], abs=1e-4)


def test_profile_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(PrivacyProfileError, match="bench edge-privacy"):
        PrivacyProfile.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": "m", "top1": {}, "surprise": 1}))
    with pytest.raises(PrivacyProfileError, match="surprise"):
        PrivacyProfile.load(bad)

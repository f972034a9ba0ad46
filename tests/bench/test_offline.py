"""`hetero-pd bench offline` on the tiny model, and the parts it compares with."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from hetero_pd.bench import offline
from hetero_pd.bench.offline import compare_tokens, main
from hetero_pd.bench.offline_side import SideResult, SideSpec

pytestmark = pytest.mark.timeout(600)


def test_compare_tokens_reports_where_the_sides_part() -> None:
    same = compare_tokens([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]])
    assert (same.mismatched, same.first_difference, same.agreement_pct) == ([], None, 100.0)
    diff = compare_tokens([[1, 2, 3], [4, 5, 6], [7]], [[1, 2, 3], [4, 9, 6], [8]])
    assert diff.mismatched == [1, 2]
    assert diff.first_difference == (1, 1)
    assert diff.agreement_pct == pytest.approx(100 * 4 / 7, abs=0.01)
    with pytest.raises(ValueError, match="answered 1 and 2 prompts"):
        compare_tokens([[1]], [[1], [2]])


def test_bench_offline_smoke(
    text_llama_dir: Path,
    capsys: pytest.CaptureFixture[str],
    recorded_loads: Callable[[ModuleType], list[int]],
) -> None:
    """One round, each side in a real process of its own: the engine with its step compiled,
    the same engine eager (`--eager-baseline`) and transformers, all three giving the same
    greedy tokens (the rounds' order and their summary:
    test_rounds_alternate_which_side_goes_first)."""
    loads = recorded_loads(offline)
    argv = ["--model", str(text_llama_dir), "--num-prompts", "3", "--max-tokens", "6"]
    argv += ["--repeats", "1", "--warmup-prompts", "2", "--threads", "1"]
    argv += ["--kv-cache-gb", "0.05", "--background-load", "1"]
    argv += ["--compile", "on", "--eager-baseline"]
    assert main(argv) == 0
    assert loads == [1]  # --background-load reached the load around the measurement
    captured = capsys.readouterr()
    res = json.loads(captured.out.strip().splitlines()[-1])

    assert res["num_prompts"] == 3 and res["max_tokens"] == 6 and res["repeats"] == 1
    assert res["dtype"] == res["dtype_requested"] == "float32"
    assert res["background_load"] == 1
    assert res["first_side"] == ["engine"]
    assert len(res["engine_tok_s_runs"]) == len(res["transformers_tok_s_runs"]) == 1
    assert res["ratio_min"] <= res["ratio"] <= res["ratio_max"]
    assert res["engine_tok_s"] > 0 and res["transformers_tok_s"] > 0
    assert res["peak_rss_mb"] > 0 and res["transformers_peak_rss_mb"] > 0
    # Same token ids in, same greedy tokens out: transformers is the reference.
    assert res["token_mismatches"] == 0 and res["token_agreement_pct"] == 100.0
    assert "18 tokens in" in captured.err  # 3 prompts x 6 tokens, EOS never stops them
    # The compiled step against the same engine eager: same tokens.
    assert res["compile"] == "on" and res["compiled"] is True
    assert len(res["engine_eager_tok_s_runs"]) == 1 and res["engine_eager_tok_s"] > 0
    assert res["compile_speedup_min"] <= res["compile_speedup"] <= res["compile_speedup_max"]
    assert res["eager_token_mismatches"] == 0


def test_rounds_alternate_which_side_goes_first(
    text_llama_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over three rounds the sides take turns going first; `auto` is resolved by round 0's
    engine and asked of every later run; the ratio is the median of the rounds' ratios.
    Each side's process is replaced by a record of what it was asked (the smoke test above
    runs the real processes): the rounds' logic alone, without six model loads."""
    asked: list[tuple[str, str]] = []
    elapsed = iter([1.0, 2.0, 0.25, 1.0, 1.0, 3.0])  # engine/hf ratios 2, 0.25, 3

    def side(spec: SideSpec, timeout_s: float) -> SideResult:
        asked.append((spec.side, spec.dtype))
        tokens = [[7] * spec.max_tokens for _ in spec.prompts]
        return SideResult(spec.side, "bfloat16", next(elapsed), tokens, 100.0)

    monkeypatch.setattr(offline, "run_in_process", side)
    argv = ["--model", str(text_llama_dir), "--num-prompts", "2", "--max-tokens", "3"]
    assert main([*argv, "--repeats", "3", "--dtype", "auto"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    sides = [s for s, _ in asked]
    assert sides == ["engine", "transformers", "transformers", "engine", "engine", "transformers"]
    assert [d for _, d in asked] == ["auto"] + ["bfloat16"] * 5
    assert res["first_side"] == ["engine", "transformers", "engine"]
    assert (res["dtype"], res["dtype_requested"], res["repeats"]) == ("bfloat16", "auto", 3)
    assert res["engine_tok_s_runs"] == [6.0, 6.0, 6.0]
    assert res["transformers_tok_s_runs"] == [3.0, 24.0, 2.0]
    assert (res["ratio_min"], res["ratio"], res["ratio_max"]) == (0.25, 2.0, 3.0)
    assert res["token_mismatches"] == 0


def test_skip_transformers_runs_the_engine_sides_only(
    text_llama_dir: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--eager-baseline --skip-transformers`: the compiled engine and the eager one take
    turns going first, no transformers side runs and no ratio against it is reported (the
    side processes replaced by records, as above; the smoke test runs the real ones)."""
    asked: list[str] = []

    def side(spec: SideSpec, timeout_s: float) -> SideResult:
        asked.append(spec.side)
        tokens = [[7] * spec.max_tokens for _ in spec.prompts]
        return SideResult(spec.side, "float32", 1.0, tokens, 100.0, spec.side == "engine")

    monkeypatch.setattr(offline, "run_in_process", side)
    argv = ["--model", str(text_llama_dir), "--num-prompts", "2", "--max-tokens", "3"]
    argv += ["--repeats", "2", "--compile", "on", "--eager-baseline", "--skip-transformers"]
    assert main(argv) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert asked == ["engine", "eager", "eager", "engine"]
    assert res["compiled"] is True and res["engine_eager_tok_s_runs"] == [6.0, 6.0]
    assert res["compile_speedup"] == 1.0 and res["eager_token_mismatches"] == 0
    assert not {"ratio", "transformers_tok_s", "token_mismatches"} & set(res)


def test_bad_arguments_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--repeats", "0"], ["--background-load", "65"], ["--dtype", "int8"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
    assert "--background-load must be in [0, 64]" in capsys.readouterr().err

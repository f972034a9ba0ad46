"""`hetero-pd bench edge` on the tiny model: the final JSON line and its definitions."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetero_pd.bench.edge import error_pct, main, tpot_s

pytestmark = pytest.mark.timeout(600)


def test_one_tpot_and_a_raw_error() -> None:
    assert tpot_s(0.5, 1.1, 4) == pytest.approx(0.2)  # 3 gaps between 4 tokens
    assert tpot_s(0.5, 0.5, 1) == 0.0
    assert error_pct(predicted=0.09, measured=0.1) == pytest.approx(10.0)
    assert error_pct(predicted=0.12, measured=0.1) == pytest.approx(20.0)
    # every token of a stream in one chunk: TPOT 0, and no error to score against it
    assert error_pct(predicted=0.12, measured=0.0) is None


def test_bench_edge_smoke(text_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", str(text_llama_dir), "--split", "1", "--codec", "int8"]
    argv += ["--num-prompts", "2", "--prompt-words", "10", "--max-tokens", "4", "--link", "lan"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    res = json.loads(out.strip().splitlines()[-1])

    assert (res["split_layer"], res["codec"], res["num_prompts"]) == (1, "int8", 2)
    assert res["mode"] == "split" and res["tls"]
    assert res["link"] == "lan" and "link: 1000 Mbit/s, 0.5 ms RTT, 0% loss" in out
    assert res["split_tokens"] == res["unsplit_tokens"] == 2 * 4  # EOS never stops them
    assert res["split_ttft_ms"] > 0 and res["split_tpot_ms"] > 0  # the device times each token
    # The server may send a short stream's tokens in one chunk: a TPOT of 0, then no error.
    assert res["unsplit_ttft_ms"] > 0 and res["unsplit_tpot_ms"] >= 0
    if res["unsplit_tpot_ms"] == 0:
        assert res["planner_unsplit_tpot_error_pct"] is None
    # The error is the planner's own prediction against the measurement, nothing corrected.
    for name in ("ttft", "tpot"):
        predicted, measured = res[f"predicted_{name}_ms"], res[f"split_{name}_ms"]
        want = abs(predicted - measured) / measured * 100
        assert res[f"planner_{name}_error_pct"] == pytest.approx(want, abs=0.2)
    assert res["bytes_per_prompt"] > 0 and res["bytes_per_token"] > 0
    assert 0 <= res["codec_token_agreement_pct"] <= 100
    assert "serving path" in out


def test_bench_edge_prompt_only(text_llama_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", str(text_llama_dir), "--split", "1", "--mode", "prompt_only"]
    argv += ["--num-prompts", "1", "--prompt-words", "10", "--max-tokens", "4"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    res = json.loads(out.strip().splitlines()[-1])

    assert (res["mode"], res["tls"]) == ("prompt_only", False)  # whole-model: no edge listener
    assert res["prompt_only_tokens"] == res["unsplit_tokens"] == 4
    assert res["prompt_only_tpot_ms"] > 0 and "split_tpot_ms" not in res
    # Hidden states and early KV with the prompt, then nothing: the cloud decodes alone.
    assert res["bytes_per_prompt"] > 0 and res["bytes_per_token"] == 0
    # The planner's prediction is the split mode's: shown, never scored against this run.
    assert res["predicted_mode"] == "split" and "planner_tpot_error_pct" not in res
    assert "the planner models split mode" in out

"""Every benchmark lives under hetero_pd/bench/ and is reached through `hetero-pd bench`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetero_pd.cli import main


@pytest.mark.parametrize("name", ["offline", "pd", "edge", "serve"])
def test_bench_commands_answer_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", name, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: hetero-pd bench {name}")


def test_bench_routing_reports_its_workload(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`hetero-pd bench routing` on the tiny model, one configuration (1 prefill + 1 decode
    worker): a table row, then a JSON line whose counts follow from the arguments. Without
    fed-back replies, turn t's prompt is the system prompt and t user messages."""
    workload = "--prefill 1 --sessions 2 --turns 2 --system-tokens 40 --user-tokens 8"
    args = [*workload.split(), "--max-tokens", "4", "--no-feed-replies", "--configs", "kv_aware"]
    assert main(["bench", "routing", "--model", str(tiny_llama_dir), *args]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split(" | ")[:2] == ["config", "ttft_p50_ms"]
    assert lines[1].startswith("kv_aware | ")
    report = json.loads(lines[-1])
    assert report["greedy_replies_identical"] is True
    w = report["workload"]
    assert (w["sessions"], w["turns"], w["max_tokens"], w["feed_replies"]) == (2, 2, 4, False)
    (run,) = report["runs"]
    assert run["config"] == "kv_aware" and run["requests"] == 2 * 2
    assert run["prompt_tokens"] == 2 * ((40 + 8) + (40 + 2 * 8))
    assert 0 < run["prompt_tokens_computed"] <= run["prompt_tokens"]
    decisions = run["decisions"]
    assert decisions["disaggregated"] + decisions["local_prefill"] == run["requests"]
    assert decisions["recompute"] == decisions["prefix_pull"] == 0  # kv_aware: no pulls
    assert (run["kv_bytes_pushed"] > 0) == (decisions["disaggregated"] > 0)
    assert 0 < run["ttft_p50_ms"] <= run["ttft_p99_ms"]

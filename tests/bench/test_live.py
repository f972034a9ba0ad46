"""`hetero-pd bench serve` end to end against a live (fake, test-only) streaming server.

The server's delays are the ground truth: TTFT must be at least the configured first-token
delay and not much more; bounds are generous because CI machines are noisy.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hetero_pd.bench.serve import main

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

pytestmark = pytest.mark.timeout(60)


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, dict[str, Any]]:
    code = main([*argv, "--disable-tqdm"])
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    return code, out, json.loads(last) if last.startswith("{") else {}


def test_completions_with_rejections(
    fake_server: Callable[..., Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = fake_server(ttft=0.15, itl=0.02)
    prompts = ["alpha beta", "REJECT me", "gamma", "FAIL500 here", "delta", "REJECT again"]
    data = tmp_path / "w.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "max_tokens": 5}) + "\n" for p in prompts))
    argv = ["--url", server.url, "--dataset", str(data), "--slo", "ttft:1500", "tpot:300"]
    argv += ["--result-json", str(tmp_path / "r.json"), "--plot-dir", str(tmp_path / "plots")]
    code, out, res = run(argv, capsys)

    assert code == 0
    assert "Serving Benchmark Result" in out
    assert res["model"] == "fake-model"  # discovered through GET /v1/models
    assert server.received == 7  # six plus the pre-flight request
    assert (res["num_requests"], res["completed"], res["failed"]) == (6, 3, 3)
    assert (res["rejected"], res["server_errors"], res["other_errors"]) == (2, 1, 0)
    assert res["good_requests"] == 3
    assert res["slo_attainment"] == pytest.approx(0.5)
    assert res["request_goodput"] == pytest.approx(3 / res["duration"])
    assert res["total_output_tokens"] == 15  # from the server's usage chunks
    assert res["total_input_tokens"] == 21  # the fake server reports 7 prompt tokens
    assert 150 <= res["mean_ttft_ms"] < 1150
    assert 150 <= res["p50_ttft_ms"] <= res["p90_ttft_ms"] <= res["p99_ttft_ms"] < 1150
    assert 15 <= res["mean_tpot_ms"] < 300
    assert 15 <= res["mean_itl_ms"] < 300
    assert res["mean_e2el_ms"] >= 150 + 4 * 20 - 5
    assert any("server overloaded" in e for e in res["error_samples"])

    full = json.loads((tmp_path / "r.json").read_text())
    assert [r["status"] for r in full["requests"]] == [200, 429, 200, 500, 200, 429]
    assert all(len(r["itl_ms"]) == 4 for r in full["requests"] if r["success"])
    assert res["plots"] == [str(tmp_path / "plots" / "latency_cdf.png")]
    assert Path(res["plots"][0]).read_bytes()[:8] == PNG_MAGIC


def test_chat_without_usage_counts_chunks(
    fake_server: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    server = fake_server(ttft=0.1, itl=0.02)
    argv = ["--url", server.url + "/v1", "--model", "m", "--endpoint", "chat"]
    argv += ["--dataset", "random", "--random-input-len", "8", "--random-output-len", "4"]
    argv += ["--num-prompts", "4", "--rate", "50", "--burstiness", "0.5"]
    argv += ["--max-concurrency", "2", "--no-initial-test"]
    argv += ["--extra-body", '{"stream_options": {"include_usage": false}}']
    code, _, res = run(argv, capsys)

    assert code == 0
    assert server.received == 4
    assert res["completed"] == 4 and res["failed"] == 0
    assert res["total_output_tokens"] == 16  # four content chunks each, no usage chunk
    assert res["total_input_tokens"] == 32  # the dataset's estimate
    assert res["mean_ttft_ms"] >= 100  # the role-only chunk is not the first token
    assert res["slo_attainment"] is None and res["good_requests"] is None
    # two at a time, each request ~0.16 s: at least two rounds
    assert res["duration"] >= 2 * (0.1 + 3 * 0.02) * 0.9
    assert res["max_concurrency"] == 2 and res["request_rate"] == 50


def test_sweep_finds_a_goodput_on_a_one_at_a_time_server(
    fake_server: Callable[..., Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = fake_server(ttft=0.03, itl=0.01, serial=True)  # ~0.06 s per request, serialized
    argv = ["--url", server.url, "--model", "m", "--num-prompts", "12"]
    argv += ["--random-input-len", "4", "--random-output-len", "4", "--slo", "ttft:400"]
    argv += ["--sweep", "--sweep-min-rate", "6", "--sweep-max-rate", "400", "--seed", "4"]
    argv += ["--sweep-max-probes", "3", "--plot-dir", str(tmp_path)]
    code, out, res = run(argv, capsys)

    assert code == 0
    assert "Goodput sweep" in out
    sweep = res["sweep"]
    rates = [p["request_rate"] for p in sweep["probes"]]
    assert len(rates) == 3 and rates[:2] == [6, 400]
    assert sweep["probes"][1]["slo_attainment"] < 0.9  # 12 at once queue past 400 ms
    assert sweep["goodput_rate"] is not None and 6 <= sweep["goodput_rate"] < 400
    assert not sweep["saturated"]
    # Each probe sends prompts of its own: repeated ones would be served from the server's
    # prefix cache after the first probe, and later probes would measure the cache.
    probes = [set(server.prompts[1 + 12 * i : 1 + 12 * (i + 1)]) for i in range(3)]
    assert len(server.prompts) == 1 + 3 * 12 and all(len(p) == 12 for p in probes)
    assert not (probes[0] & probes[1] or probes[0] & probes[2] or probes[1] & probes[2])
    for name in ("attainment_vs_rate.png", "latency_cdf.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC


def test_unreachable_server_and_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = main(["--url", f"http://127.0.0.1:{port}", "--model", "m", "--num-prompts", "2"])
    assert code == 1
    assert "cannot benchmark" in capsys.readouterr().err
    assert main(["--sweep", "--num-prompts", "2"]) == 2
    assert "--sweep needs an SLO" in capsys.readouterr().err
    assert main(["--dataset", str(tmp_path / "nope.jsonl")]) == 2
    assert "is not random, mixed or a file" in capsys.readouterr().err

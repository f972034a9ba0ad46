"""`hetero-pd bench kv` end to end on a tiny model: three configurations in one run, the
same greedy replies in each, and the tiers computing fewer prompt tokens than no tiers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hetero_pd.bench import kv


def test_bench_kv_runs_every_configuration(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "--model",
        str(tiny_llama_dir),
        "--sessions=8",
        "--turns=5",
        "--system-tokens=32",
        "--user-tokens=16",
        "--max-tokens=8",
        "--block-size=8",
        "--threads=1",
        "--host-blocks=60",
        "--disk-gb=0.01",
    ]
    assert kv.main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["replies_identical"] is True
    assert report["device_blocks"] < report["working_set_blocks"]
    configs = report["configs"]
    assert list(configs) == ["off", "dram", "dram+ssd"]
    for c in configs.values():
        assert c["requests"] == 40 and c["ttft_p99_ms"] >= c["ttft_p50_ms"] > 0
    off, dram, ssd = (configs[n]["prefill_tokens_computed"] for n in configs)
    assert dram < off and ssd < off
    assert configs["dram"]["host_hits"] > 0 and "host_hits" not in configs["off"]
    assert configs["dram+ssd"]["disk_hits"] > 0


def test_unknown_configuration_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert kv.main(["--configs", "off,nvme"]) == 2
    assert "nvme" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("model_fixture", "per_layer"),
    [
        ("tiny_llama_dir", 2 * 2 * 16),  # K and V, 2 kv heads x head_dim 16
        ("tiny_qwen3_moe_dir", 2 * 2 * 32),  # K and V, 2 kv heads x head_dim 32
        ("tiny_deepseek_v3_dir", 32 + 16),  # MLA: kv_lora_rank + qk_rope_head_dim, no heads
    ],
)
def test_bench_kv_reports_kv_bytes_of_each_family(
    model_fixture: str,
    per_layer: int,
    request: pytest.FixtureRequest,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = request.getfixturevalue(model_fixture)
    argv = ["--model", str(path), "--configs=off", "--sessions=2", "--turns=2"]
    argv += ["--system-tokens=16", "--user-tokens=8", "--max-tokens=2", "--block-size=8"]
    assert kv.main(argv) == 0
    sizes = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["kv"]
    assert sizes["bytes_per_token_per_layer"] == per_layer * 4  # float32
    assert sizes["bytes_per_token"] == 3 * per_layer * 4  # three layers
    assert sizes["block_bytes"] == 8 * sizes["bytes_per_token"]
    # 4 requests: 2 chats x 2 turns; turn 1 is system + user (24), turn 2 adds 2 + 8 more.
    assert sizes["prompt_bytes_per_request"] == (2 * 24 + 2 * 34) * sizes["bytes_per_token"] // 4
    assert 0 < sizes["suffix_bytes_per_request"] < sizes["prompt_bytes_per_request"]

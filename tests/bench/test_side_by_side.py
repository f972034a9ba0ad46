"""scripts/vllm_side_by_side.sh without vLLM: its offline mode runs hetero-pd's side on the
tiny model and ends with one JSON line; its ratios; and it names no package index."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "vllm_side_by_side.sh"

pytestmark = pytest.mark.timeout(600)


def test_names_no_package_index() -> None:
    for path in (p for p in (REPO / "scripts").rglob("*") if p.is_file()):
        text = path.read_text()
        for word in ("index-url", "find-links", "trusted-host", "pypi.org", "pytorch.org"):
            assert word not in text, f"{path.name} names a package index ({word})"
        urls = re.findall(r"https?://[^\s\"'}]+", text)
        assert all(u.startswith("http://127.0.0.1") for u in urls), (path.name, urls)


def offline(model: Path, out: Path, dtype: str, prompts: int, tokens: int) -> Any:
    """The script in offline mode without vLLM: its finished process."""
    env = {**os.environ, "HPD_PY": sys.executable, "PYTHONPATH": str(REPO)}
    cmd = [str(SCRIPT), "--mode", "offline", "--skip-vllm", "--dtype", dtype]
    cmd += ["--model-dir", str(model), "--repeats", "1", "--offline-prompts", str(prompts)]
    cmd += ["--offline-max-tokens", str(tokens), "--out", str(out)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=500)


def test_offline_mode_ends_with_one_json_line(text_llama_dir: Path, tmp_path: Path) -> None:
    done = offline(text_llama_dir, tmp_path, "auto", 2, 4)
    assert done.returncode == 0, done.stderr[-3000:]
    res = json.loads(done.stdout.strip().splitlines()[-1])
    assert res["mode"] == "offline" and res["rounds"] == 1
    assert res["dtype"] in ("float32", "bfloat16")  # auto, resolved by the engine
    assert res["hetero_pd_tok_s"] > 0 and "ratio" not in res  # no vLLM side: no ratio
    assert json.loads((tmp_path / "ratios.json").read_text()) == res
    assert "--dtype auto: hetero-pd's engine picks" in done.stderr


def test_several_dtypes_run_in_turn(text_llama_dir: Path, tmp_path: Path) -> None:
    """`--dtype float32,bfloat16`: one run of the script per dtype, each in its own folder
    under --out, each ending with its own JSON line."""
    done = offline(text_llama_dir, tmp_path, "float32,bfloat16", 1, 2)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.strip().splitlines()[-2:]]
    assert [r["dtype"] for r in lines] == ["float32", "bfloat16"]
    for dtype in ("float32", "bfloat16"):
        assert (tmp_path / dtype / "ratios.json").is_file()
    refused = offline(text_llama_dir, tmp_path / "x", "float32,float64", 1, 2)
    assert refused.returncode != 0 and "joined by commas" in refused.stderr


def test_serve_ratios_are_hetero_pd_over_vllm(tmp_path: Path) -> None:
    vllm, hpd = tmp_path / "vllm.json", tmp_path / "hetero-pd.json"
    vllm.write_text(json.dumps({"output_throughput": 80.0, "p99_ttft_ms": 300.0, "completed": 4}))
    hpd.write_text(json.dumps({"output_throughput": 120.0, "p99_ttft_ms": 150.0, "completed": 4}))
    script = [sys.executable, str(REPO / "scripts" / "side_by_side.py"), "serve-ratios"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [*script, str(vllm), str(hpd), "--dtype", "float32"],
        env=env, capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    res = json.loads(out.strip().splitlines()[-1])
    assert res["output_throughput_ratio"] == 1.5 and res["ttft_p99_ratio"] == 0.5
    assert res["hetero_pd_output_throughput"] == 120.0 and res["vllm_p99_ttft_ms"] == 300.0
    assert res["tpot_p99_ratio"] is None  # absent on both sides
    assert res["mode"] == "serve" and res["dtype"] == "float32"


def test_serve_ratios_compare_swept_goodput(tmp_path: Path) -> None:
    """With --sweep each side's result holds the goodput rate its search found: the ratio is
    ours over vLLM's, and a side whose search hit its top rate is named (a floor, not a rate)."""
    vllm, hpd = tmp_path / "vllm.json", tmp_path / "hetero-pd.json"
    slo = {"ttft_ms": 2000.0, "tpot_ms": 200.0}

    def swept(rate: float, saturated: bool, probes: int) -> dict[str, object]:
        sweep = {"goodput_rate": rate, "saturated": saturated, "target": 0.9}
        return {"slo": slo, "sweep": {**sweep, "probes": [{}] * probes}}

    vllm.write_text(json.dumps(swept(0.5, False, 5)))
    hpd.write_text(json.dumps(swept(0.8, True, 2)))
    script = [sys.executable, str(REPO / "scripts" / "side_by_side.py"), "serve-ratios"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [*script, str(vllm), str(hpd)], env=env, capture_output=True, text=True, timeout=120,
        check=True,
    ).stdout  # fmt: skip
    res = json.loads(out.strip().splitlines()[-1])
    assert res["goodput_rate_ratio"] == 1.6
    assert res["hetero_pd_goodput_rate"] == 0.8 and res["vllm_goodput_rate"] == 0.5
    assert res["saturated"] == {"hetero_pd": True, "vllm": False}
    assert res["probes"] == {"hetero_pd": 2, "vllm": 5}
    assert res["slo"] == slo and res["sweep_target"] == 0.9
    assert "output_throughput_ratio" not in res  # a sweep has no single run's throughput


def test_config_copy_sets_dtype_and_a_router_port(tmp_path: Path) -> None:
    out = tmp_path / "local.yaml"
    script = [sys.executable, str(REPO / "scripts" / "side_by_side.py"), "config"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run(
        [*script, str(REPO / "configs" / "local.yaml"), "bfloat16", str(out), "--port", "4321"],
        env=env, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    raw = yaml.safe_load(out.read_text())
    assert raw["dtype"] == "bfloat16"
    assert raw["router"]["port"] == 4321 and raw["router"]["host"] == "127.0.0.1"
    assert (
        raw["workers"] == yaml.safe_load((REPO / "configs" / "local.yaml").read_text())["workers"]
    )


def test_roofline_gives_each_served_run_its_share_of_the_gemm_rate(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """Two `bench serve` results of one workload (the fields roofline reads): the same model
    FLOPs, and a run that took half the time reaches twice the share."""
    results = []
    for label, duration in (("vllm", 2.0), ("hetero-pd-local", 1.0)):
        path = tmp_path / f"{label}.json"
        fields = {"label": label, "completed": 4, "duration": duration}
        path.write_text(json.dumps({**fields, "total_input_tokens": 32, "total_output_tokens": 8}))
        results.append(str(path))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, str(REPO / "scripts" / "side_by_side.py"), "roofline"]
    cmd += [str(tiny_llama_dir), "float32", *results, "--rows", "16", "--repeats", "1"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    vllm, ours = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    assert (vllm["label"], ours["label"]) == ("vllm", "hetero-pd-local")
    assert vllm["model_gflop"] == ours["model_gflop"] > 0 and ours["dtype"] == "float32"
    assert vllm["gemm_gflops"] == ours["gemm_gflops"] > 0 and ours["gemm_rows"] == 16
    assert ours["achieved_gflops"] == pytest.approx(2 * vllm["achieved_gflops"], rel=1e-3)
    share = ours["achieved_gflops"] / ours["gemm_gflops"]
    assert ours["roofline_share"] == pytest.approx(share, abs=1e-3)

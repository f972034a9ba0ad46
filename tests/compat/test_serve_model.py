"""`hetero-pd serve MODEL`: the deployment built from vLLM's flag names, and what each kind
of target (folder, known name, repo id, deployment file, other folder) resolves to."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hetero_pd.cli import VERSION, main
from hetero_pd.deploy.model_deployment import resolve_model_target
from hetero_pd.deploy.sections import EngineSpec
from hetero_pd.deploy.serve import build_parser, load_target
from hetero_pd.models.fetch import ModelNotFoundError

REPO = Path(__file__).resolve().parents[2]


def _load(*argv: str) -> tuple[object, str]:
    p = build_parser()
    return load_target(p, p.parse_args(list(argv)))


def _workers(dep: object) -> list[tuple[str, str, int]]:
    return [(w.role, w.device, w.count) for w in dep.workers]  # type: ignore[attr-defined]


def test_a_model_folder_gets_one_prefill_and_one_decode_worker(tiny_llama_dir: Path) -> None:
    dep, name = _load(str(tiny_llama_dir))
    assert _workers(dep) == [("prefill", "cpu", 1), ("decode", "cpu", 1)]
    assert dep.model == str(tiny_llama_dir) and name == str(tiny_llama_dir)  # type: ignore[attr-defined]
    assert dep.router.host == "127.0.0.1" and dep.router.port == 8000  # type: ignore[attr-defined]
    assert dep.engine == EngineSpec()  # type: ignore[attr-defined]


def test_vllm_flags_set_the_deployment(tiny_llama_dir: Path) -> None:
    dep, _ = _load(
        str(tiny_llama_dir),
        *("--pd", "2:3", "--host", "0.0.0.0", "--port", "0", "--dtype", "float32"),
        *("--max-model-len", "256", "--max-num-seqs", "8", "--max-num-batched-tokens", "128"),
        *("--block-size", "32", "--no-enable-prefix-caching", "--seed", "7"),
        *("--api-key", "k1", "--kv-cache-gb", "0.25"),
    )
    assert _workers(dep) == [("prefill", "cpu", 2), ("decode", "cpu", 3)]
    assert dep.engine == EngineSpec(  # type: ignore[attr-defined]
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=128,
        block_size=32,
        enable_prefix_caching=False,
        seed=7,
        kv_cache_gb=0.25,
    )
    router = dep.router  # type: ignore[attr-defined]
    assert (router.host, router.port, router.api_keys) == ("0.0.0.0", 0, ("k1",))
    assert dep.dtype == "float32"  # type: ignore[attr-defined]


def test_colocated_is_one_worker_that_does_both(tiny_llama_dir: Path) -> None:
    dep, _ = _load(str(tiny_llama_dir), "--colocated")
    assert _workers(dep) == [("both", "cpu", 1)]


def test_api_keys_come_from_the_flag_and_the_environment(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HETERO_PD_API_KEY", "e1, e2,")
    dep, _ = _load(str(tiny_llama_dir), "--api-key", "k")
    assert dep.router.api_keys == ("k", "e1", "e2")  # type: ignore[attr-defined]


def test_an_api_key_file_keeps_keys_off_the_command_line(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Any user of the machine reads argv (ps, /proc): --api-key-file reads the keys from a
    file instead, and --api-key still works (vLLM's flag) but says so."""
    keys = tmp_path / "keys"
    keys.write_text("k-file\n\nk2, k3\n")
    dep, _ = _load(str(tiny_llama_dir), "--api-key-file", str(keys))
    assert dep.router.api_keys == ("k-file", "k2", "k3")  # type: ignore[attr-defined]
    assert "warning" not in capsys.readouterr().err
    _load(str(tiny_llama_dir), "--api-key", "k")
    err = capsys.readouterr().err
    assert "--api-key puts the key on the command line" in err and "--api-key-file" in err
    with pytest.raises(SystemExit):
        _load(str(tiny_llama_dir), "--api-key-file", str(tmp_path / "missing"))
    assert "missing" in capsys.readouterr().err


def test_priority_keys_come_from_the_environment_as_a_pod_gets_them(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`render k8s` moves `router.priority_api_keys` into the Secret; the router's pod reads
    them back from HETERO_PD_PRIORITY_API_KEY."""
    monkeypatch.setenv("HETERO_PD_API_KEY", "e1,vip")
    monkeypatch.setenv("HETERO_PD_PRIORITY_API_KEY", " vip,")
    dep, _ = _load(str(tiny_llama_dir))
    assert dep.router.priority_api_keys == ("vip",)  # type: ignore[attr-defined]


def test_bad_flag_values_name_the_flag(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match=r"--max-num-seqs: .*must be > 0"):
        _load(str(tiny_llama_dir), "--max-num-seqs", "0")
    with pytest.raises(SystemExit):
        _load(str(tiny_llama_dir), "--pd", "1:0")
    assert "is not a P:D ratio" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not both"):
        _load(str(tiny_llama_dir), "--pd", "1:1", "--colocated")


def test_a_known_name_is_kept_for_the_workers(default_model_dir: Path) -> None:
    dep, name = _load("SmolLM2-135M-Instruct")
    assert dep.model == "smollm2-135m-instruct"  # type: ignore[attr-defined]
    assert name == "SmolLM2-135M-Instruct", "clients send the name as the user typed it"


def test_a_deployment_file_still_works_and_refuses_model_flags(
    tmp_path: Path, tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "d.yaml"
    path.write_text(f"model: {tiny_llama_dir}\nworkers: [{{role: both}}]\n")
    dep, name = _load(str(path), "--port", "0", "--api-key", "k")
    assert _workers(dep) == [("both", "cpu", 1)] and name == str(tiny_llama_dir)
    assert dep.router.port == 0 and dep.router.api_keys == ("k",)  # type: ignore[attr-defined]
    with pytest.raises(SystemExit):
        _load(str(path), "--max-num-seqs", "4", "--pd", "1:1")
    err = capsys.readouterr().err
    assert "--max-num-seqs, --pd" in err and "deployment file" in err


def test_a_folder_that_is_not_a_model_says_what_to_do(tmp_path: Path) -> None:
    (tmp_path / "local.yaml").write_text("model: x\n")
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model_target(str(tmp_path))
    message = str(e.value)
    assert "not a model: it has no config.json" in message
    assert f"hetero-pd serve {tmp_path / 'local.yaml'}" in message


def _resolve_offline(target: str, hf_home: Path) -> subprocess.CompletedProcess[str]:
    """resolve_model_target in a fresh process (huggingface_hub reads its environment at
    import), offline (no network here: the hub must not be tried for long)."""
    code = (
        "import sys\n"
        "from hetero_pd.deploy.model_deployment import resolve_model_target\n"
        "print(resolve_model_target(sys.argv[1]))\n"
    )
    env = {**os.environ, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", code, target], capture_output=True, text=True, env=env, timeout=120
    )


def test_an_unresolvable_repo_id_is_a_clear_error(tmp_path: Path) -> None:
    result = _resolve_offline("no-such-org/no-such-model", tmp_path / "hf")
    assert result.returncode != 0
    message = result.stderr.strip().splitlines()[-1]
    assert message.startswith("hetero_pd.models.fetch.ModelNotFoundError")
    assert "cannot resolve the Hugging Face repo id 'no-such-org/no-such-model'" in message
    assert "not in the local hub cache" in message and "local model folder" in message


def test_a_cached_repo_id_resolves_to_its_snapshot(tmp_path: Path, tiny_llama_dir: Path) -> None:
    """A repo in the hub cache layout (what `hf download` leaves) is served without network."""
    hub = tmp_path / "hf" / "hub" / "models--acme--tiny"
    snapshot = hub / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for f in tiny_llama_dir.iterdir():
        (snapshot / f.name).symlink_to(f)
    (hub / "refs").mkdir()
    (hub / "refs" / "main").write_text("0" * 40)
    result = _resolve_offline("acme/tiny", tmp_path / "hf")
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).resolve() == snapshot.resolve()


def test_neither_file_nor_model_nor_name(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="neither a deployment file, a model folder"):
        resolve_model_target(str(tmp_path / "missing"))


@pytest.mark.parametrize(
    "argv",
    [
        ["--version"],
        ["serve", "--version"],
        ["generate", "--version"],
        ["bench", "serve", "--version"],
        ["validate", "--version"],
        ["edge", "plan", "--version"],
    ],
)
def test_version_on_every_command(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own version action
        code = int(e.code or 0)
    assert code == 0
    assert capsys.readouterr().out.strip() == VERSION


def test_pd_ratio_type_rejects_garbage() -> None:
    from hetero_pd.deploy.model_deployment import PDRatio

    assert PDRatio.parse(" 2 : 1 ") == PDRatio(2, 1)
    for bad in ("1", "a:b", "0:1", "1:1:1"):
        with pytest.raises(argparse.ArgumentTypeError):
            PDRatio.parse(bad)

"""The `hetero-pd` command line, run as users run it (a subprocess) where it matters."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from hetero_pd.cli import main

REPO = Path(__file__).resolve().parents[1]


def hetero_pd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hetero_pd.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def test_help_lists_the_commands() -> None:
    result = hetero_pd("--help", timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: hetero-pd")
    for command in ("fetch-model", "devices", "generate", "bench"):
        assert command in result.stdout


@pytest.mark.dtype  # `generate` and the reference both run `auto`
def test_generate_prints_the_completion(
    tiny_llama_dir: Path, auto_dtype: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """In this process (the commands' own process, `python -m hetero_pd.cli`, is run by the
    tests of `fetch-model` and `devices`): an interpreter importing torch for each dtype
    would cost ~3 s of CPU and check nothing more. `capfd` reads file descriptor 1, so
    anything else written to stdout, by Python or by native code, still fails it."""
    from hetero_pd import LLM, SamplingParams

    assert main(["generate", "--model", str(tiny_llama_dir), "in the", "--max-tokens", "4"]) == 0
    stdout = capfd.readouterr().out
    expected = LLM(str(tiny_llama_dir), num_kv_blocks=8).generate(
        "in the", SamplingParams(temperature=0, max_tokens=4)
    )[0]
    assert expected.outputs[0].text.strip()
    assert stdout == expected.outputs[0].text + "\n"


def test_generate_chat_answers_the_templated_prompt(
    chat_model: Path, hf_greedy: Callable[..., list[int]], capsys: pytest.CaptureFixture[str]
) -> None:
    """`generate --chat`: the prompt goes through the model's chat template, and the greedy
    answer is transformers' for the templated prompt."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_model)
    messages = [{"role": "user", "content": "in the"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nin the<|im_end|>\n<|im_start|>assistant\n"
    want = tok.decode(hf_greedy(chat_model, tok.encode(text, add_special_tokens=False), 6))
    argv = ["--model", str(chat_model), "--dtype", "float32", "--max-tokens", "6", "in the"]
    assert main(["generate", "--chat", *argv]) == 0
    assert capsys.readouterr().out == want + "\n"


def test_bad_model_path_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-such-model"
    assert main(["generate", "--model", str(missing), "hi"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hetero-pd: error:")
    assert str(missing) in err


def test_corrupt_weights_are_a_usage_error(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    (model / "model.safetensors").write_bytes(b"\x00" * 16)
    assert main(["generate", "--model", str(model), "in the", "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hetero-pd: error:")
    assert "corrupt or unreadable safetensors file" in err and str(model) in err


def test_unknown_model_name_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["fetch-model", "llama-9000"])
    assert e.value.code == 2
    assert "invalid choice: 'llama-9000'" in capsys.readouterr().err


def test_fetch_model_returns_the_cached_folder(default_model_dir: Path) -> None:
    result = hetero_pd("fetch-model", "smollm2-135m-instruct", timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(default_model_dir)
    assert "downloading" not in result.stderr, "a cached model must not be fetched again"


def test_devices_prints_a_table_with_the_cpu() -> None:
    result = hetero_pd("devices", timeout=120)
    assert result.returncode == 0, result.stderr
    header, *rows = result.stdout.splitlines()
    assert header.split()[0] == "device"
    assert any(row.split()[0] == "cpu" for row in rows), result.stdout


def test_idle_openmp_threads_spin_briefly_unless_told_otherwise() -> None:
    """Importing hetero_pd makes idle OpenMP threads spin briefly before they sleep (for
    torch, which loads OpenMP later: importing hetero_pd does not import it, and for every
    process started from here); a wait policy or spin count the user set is kept."""
    code = (
        "import hetero_pd, os, sys; e = os.environ; assert 'torch' not in sys.modules; "
        "print(e.get('OMP_WAIT_POLICY'), e.get('GOMP_SPINCOUNT'), e.get('KMP_BLOCKTIME'))"
    )
    names = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
    env = {k: v for k, v in os.environ.items() if k not in names}
    cases = (
        ({}, "None 30000 1"),
        ({"OMP_WAIT_POLICY": "PASSIVE"}, "PASSIVE None None"),
        ({"GOMP_SPINCOUNT": "5"}, "None 5 1"),
    )
    for given, want in cases:
        out = subprocess.run(
            [sys.executable, "-c", code],
            env={**env, **given},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == want


def test_serve_names_the_supported_architectures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    assert main(["serve", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hetero-pd: error:") and "unsupported architecture" in err
    from hetero_pd.models.config import SUPPORTED_ARCHITECTURES

    assert all(arch in err for arch in SUPPORTED_ARCHITECTURES), err

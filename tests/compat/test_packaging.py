"""Packaging: runtime dependencies are what serving needs; optional ones are imported when
used and name their extra when missing."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from hetero_pd import __version__
from hetero_pd.extras import EXTRAS, MissingExtraError, require

REPO = Path(__file__).resolve().parents[2]


def _project() -> dict:  # type: ignore[type-arg]
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_runtime_dependencies_leave_out_optional_features() -> None:
    deps = " ".join(_project()["dependencies"])
    for name in ("matplotlib", "gguf", "accelerate", "onnx", "torch-npu"):
        assert name not in deps, f"{name} is an extra, not a runtime dependency"
    extras = _project()["optional-dependencies"]
    assert set(EXTRAS) | {"test"} == set(extras)
    assert extras["npu"] == ["torch==2.13.0", "torch-npu==2.13.0"], "torch-npu follows torch"
    assert "torch==2.13.0" in (REPO / "Makefile").read_text(), "the npu pin is the Makefile's"
    assert not any("onnxruntime" in d for d in extras["test"]), "it clashes with edge-gpu"


def test_make_test_installs_every_extra_the_tests_use() -> None:
    assert "'.[test,fetch,bench,edge]'" in (REPO / "Makefile").read_text()


def test_serving_imports_no_optional_package() -> None:
    code = (
        "import sys\n"
        "import hetero_pd.deploy.serve, hetero_pd.bench.serve, hetero_pd.cli\n"
        "loaded = [m for m in ('matplotlib', 'gguf', 'accelerate', 'onnxruntime', 'onnx')"
        " if m in sys.modules]\n"
        "print(loaded)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_a_missing_extra_is_named() -> None:
    with pytest.raises(MissingExtraError) as e:
        require("no_such_package_hetero_pd", "bench", "benchmark plots")
    assert str(e.value) == (
        "benchmark plots needs the Python package 'no_such_package_hetero_pd', which is not "
        "installed: pip install 'hetero-pd[bench]' (benchmark plots (matplotlib))"
    )
    assert require("json", "bench", "x").dumps([]) == "[]"


def test_the_version_has_one_home() -> None:
    assert _project()["dynamic"] == ["version"]
    assert __version__ == "0.1.0"

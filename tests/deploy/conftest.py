"""Helpers for the deployment-tool tests: write a YAML file, collect its issues."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.fixture
def write_yaml(tmp_path: Path) -> Callable[[str], Path]:
    """Writes dedented YAML text to a fresh file and returns its path."""
    counter = iter(range(1000))

    def write(text: str) -> Path:
        path = tmp_path / f"deploy-{next(counter)}.yaml"
        path.write_text(textwrap.dedent(text).lstrip("\n"))
        return path

    return write

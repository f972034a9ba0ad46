"""docs/ARCHITECTURE.md names only paths that exist."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOP = {p.name for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".")}


def named_paths(text: str) -> list[str]:
    """Backticked paths outside code blocks; a bare file name counts in the folder named
    last on its line (`hetero_pd/engine/` (`scheduler.py`) is hetero_pd/engine/scheduler.py),
    and so does a path that does not start at a top-level folder."""
    paths, in_code = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        folder = ""
        for token in re.findall(r"`([^`\s]+)`", line):
            if token.startswith("/"):  # an HTTP route
                continue
            if token.split("/")[0] in TOP:
                paths.append(token)
                folder = token if token.endswith("/") else folder
            elif folder and ("/" in token or token.endswith(".py")):
                paths.append(folder + token)
    return paths


def test_every_path_in_the_architecture_page_exists() -> None:
    paths = named_paths((REPO / "docs" / "ARCHITECTURE.md").read_text())
    assert len(paths) > 40
    assert [p for p in paths if not (REPO / p).exists()] == []

"""Every benchmark lives under hetero_pd/bench/ and is reached through `hetero-pd bench`."""

from __future__ import annotations

import pytest

from hetero_pd.cli import main


@pytest.mark.parametrize("name", ["offline", "pd", "edge", "serve"])
def test_bench_commands_answer_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", name, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: hetero-pd bench {name}")

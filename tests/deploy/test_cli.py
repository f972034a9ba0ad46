"""`validate` on the command line: a summary and exit 0, or file:line: key errors and 1."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from hetero_pd.deploy.cli import main, validate_main
from hetero_pd.deploy.schema import parse_deployment

from .conftest import CONFIGS


def test_valid_file_prints_a_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert validate_main([str(CONFIGS / "local.yaml"), "--no-port-check"]) == 0
    out = capsys.readouterr().out
    assert "local.yaml: valid (target local)" in out
    assert "prefill-0    prefill  cpu" in out and "decode-0     decode   cpu" in out


def test_invalid_file_exits_1_with_every_issue(
    write_yaml: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_yaml("version: 1\nmodel: smollm2-135m-instruct\nworkers: []\nrouter: {prt: 1}\n")
    assert validate_main([str(path)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert f"{path}:3: workers: must be a non-empty list" in err[0]
    assert err[1].startswith(f"{path}:4: router.prt: unknown key")


def test_k8s_target_accepts_accelerators_absent_here(capsys: pytest.CaptureFixture[str]) -> None:
    assert validate_main(["--target", "k8s", str(CONFIGS / "ascend-h100.yaml")]) == 0
    assert "prefill-0    prefill  npu (one per pod)" in capsys.readouterr().out


def test_usage_errors() -> None:
    assert main([]) == 2
    with pytest.raises(SystemExit):
        validate_main(["--target", "mars", "x.yaml"])


def test_plain_dicts_load_without_lines() -> None:
    dep = parse_deployment(
        {"model": "m", "workers": [{"role": "prefill"}, {"role": "decode", "count": 2}]}, "<t>"
    )
    assert [w.count for w in dep.workers] == [1, 2]
    with pytest.raises(ValueError, match=r"^<t>: router.port: 'x'|<t>: router.port: must be"):
        parse_deployment(
            {"model": "m", "workers": [{"role": "both"}], "router": {"port": "x"}}, "<t>"
        )

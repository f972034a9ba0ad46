"""The split planner's privacy floor: split layers whose measured token recovery is above the
maximum are refused (and unmeasured ones too), with the measured rate in the message."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge import cli as edge_cli
from edge.planner import LinkProfile, SideProfile, format_plan, plan_split
from edge.privacy import PrivacyFloorError, PrivacyProfile, default_path

MS = 1e-3
# Recovery falls with depth; k = 5 was never measured.
RECOVERY = {1: 0.95, 2: 0.40, 3: 0.08, 4: 0.03}


def uniform(layers: int, per_layer: float) -> SideProfile:
    row = (per_layer,) * layers
    return SideProfile(seq_lens=(64,), prefill_s=(row,), decode_s=(row,))


def test_floor_refuses_leaky_and_unmeasured_splits() -> None:
    cloud, link = uniform(6, 1 * MS), LinkProfile(bandwidth_bps=1e9, rtt_s=1 * MS)
    slow_edge = uniform(6, 10 * MS)  # without a floor the planner keeps one layer
    assert plan_split(slow_edge, cloud, link, prompt_len=64, hidden_size=64).best.split_layer == 1
    plan = plan_split(
        slow_edge, cloud, link, prompt_len=64, hidden_size=64, recovery=RECOVERY, max_recovery=0.1
    )
    assert plan.best.split_layer == 3  # the cheapest split that meets the floor
    assert [p.split_layer for p in plan.candidates] == [3, 4]
    refused = dict(plan.refused)
    assert sorted(refused) == [1, 2, 5]
    assert "95.0% > 10.0%" in refused[1] and "not measured" in refused[5]
    text = format_plan(plan)
    assert "refused k=2: measured top-1 recovery 40.0% > 10.0%" in text
    assert "recovery at k=3 is 8.0% (max allowed 10.0%)" in text


def test_no_split_meets_the_floor() -> None:
    side, link = uniform(6, 1 * MS), LinkProfile(bandwidth_bps=1e9, rtt_s=1 * MS)
    with pytest.raises(PrivacyFloorError, match=r"k=4: 3.0%") as err:
        plan_split(
            side, side, link, prompt_len=64, hidden_size=64, recovery=RECOVERY, max_recovery=0.01
        )
    assert "k=1: 95.0%" in str(err.value)
    with pytest.raises(ValueError, match="privacy profile"):
        plan_split(side, side, link, prompt_len=64, hidden_size=64, max_recovery=0.1)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        plan_split(
            side, side, link, prompt_len=64, hidden_size=64, recovery=RECOVERY, max_recovery=5.0
        )


def test_edge_plan_command_respects_the_floor(
    tiny_llama_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "tiny.json"
    PrivacyProfile("tiny", "nn+linear", ("float16",), {0: 1.0, 1: 0.7, 2: 0.05}).save(path)
    base = ["plan", "--model", str(tiny_llama_dir), "--prompt-len", "16", "--privacy-profile"]
    assert edge_cli.main([*base, str(path), "--max-recovery", "0.1"]) == 0
    out = capsys.readouterr().out
    assert "refused k=1: measured top-1 recovery 70.0% > 10.0%" in out
    assert "recommended k=2" in out and "recovery at k=2 is 5.0%" in out
    assert edge_cli.main([*base, str(path), "--max-recovery", "0.01"]) == 2
    assert "k=2: 5.0%" in capsys.readouterr().err
    assert edge_cli.main([*base, str(tmp_path / "none.json"), "--max-recovery", "0.1"]) == 2
    assert "bench edge-privacy" in capsys.readouterr().err


def test_deployment_and_sdk_refuse_a_split_above_the_floor(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from edge import EdgeClient, EdgeError
    from hetero_pd.deploy.source import ConfigError
    from hetero_pd.deploy.validate import validate_file

    monkeypatch.setenv("HETERO_PD_CACHE_DIR", str(tmp_path / "cache"))
    model = str(tiny_llama_dir)
    PrivacyProfile(model, "nn+linear", ("float16",), {1: 0.7, 2: 0.05}).save(default_path(model))
    yaml = tmp_path / "edge.yaml"
    head = f"version: 1\nmodel: {model}\nworkers:\n  - role: prefill\n  - role: decode\n"
    yaml.write_text(head + "edge:\n  split_layer: 1\n  max_recovery: 0.1\n")
    with pytest.raises(ConfigError, match=r"edge.max_recovery: split layer 1: measured top-1"):
        validate_file(yaml, check_ports=False)
    yaml.write_text(head + "edge:\n  split_layer: 2\n  max_recovery: 0.1\n")
    assert "split layer 2" in validate_file(yaml, check_ports=False).summary()
    yaml.write_text(head + "edge:\n  split_layer: 2\n  max_recovery: 1.5\n")
    with pytest.raises(ConfigError, match="max_recovery"):
        validate_file(yaml, check_ports=False)
    url = "http://127.0.0.1:9"  # never contacted: the floor is checked before any session
    with pytest.raises(EdgeError, match=r"privacy_floor: split layer 1: .* 70.0% is above"):
        EdgeClient(url, tiny_llama_dir, 1, model=model, max_recovery=0.1, plaintext=True)
    assert (
        EdgeClient(
            url, tiny_llama_dir, 2, model=model, max_recovery=0.1, plaintext=True
        ).split_layer
        == 2
    )

"""The drill in bare-metal mode: workers listed by host address, `hetero-pd serve CONFIG
--host-id ADDRESS` on each host (the router's too); and the drill failing, clearly, when a
worker's advertised name leads somewhere else (the test of the test)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from hetero_pd.deploy.drill import DrillError, DrillSpec, k8s_cluster
from hetero_pd.deploy.drill_run import main as drill_main

pytestmark = [pytest.mark.usefixtures("netns_ok"), pytest.mark.timeout(600)]


def test_bare_metal_hosts_through_the_drill_command(
    tiny_llama_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`hetero-pd drill multihost --mode bare-metal`: each host runs `serve CONFIG --host-id
    ADDRESS`; the answers equal the single-process engine's and the numbers are printed.
    Each host's worker runs at tensor-parallel size 2 (the k8s drill's at 1): its ranks on
    that host, its KV handed over the link as one worker's."""
    argv = ["multihost", "--mode", "bare-metal", "--model", str(tiny_llama_dir), "--prefill", "1"]
    argv += ["--requests", "4", "--prompt-len", "120", "--max-tokens", "12", "-tp", "2"]
    assert drill_main(argv) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "ok   every worker runs 2 tensor-parallel ranks" in out
    assert "ok   greedy == single-process engine (whole): 4/4" in out
    assert "ok   greedy == single-process engine (streamed): 4/4" in out
    assert "ok   every measured request prefilled remotely, KV over the link" in out
    numbers = dict(re.findall(r"^ {4}(\w[\w ]*?)\s+p50\s+(\S+)", out, re.MULTILINE))
    assert set(numbers) == {"TTFT ms", "TPOT ms", "KV bytes", "transfer ms"}
    # 120 prompt tokens of a 3-layer model with 2 KV heads of 16: 8 blocks of 16 tokens,
    # K and V, float32 -> 3 * 8 * 2 * 16 * 2 * 16 * 4 bytes
    assert float(numbers["KV bytes"]) == 3 * 8 * 2 * 16 * 2 * 16 * 4
    assert all(float(v) > 0 for v in numbers.values())
    assert "kill -9" not in out  # bare metal: no pods to kill


def test_a_broken_advertisement_fails_the_drill_clearly(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """decode-0's DNS name points at prefill-0's host: the router will not take prefill-0's
    answer for decode-0's, the pod refuses to start, and the drill stops with its reason
    instead of requests timing out one by one. The pod gives its name 1 s, not the default
    10 s, to lead back to it: the name is wrong from the start, so waiting longer would
    only end the same way later. Its pods are exec'd as a kubelet starts them, not forked
    (the other drills' default): the container's command itself, in a fresh interpreter
    with only the pod's environment, reaches the pod's own check and exit code."""
    monkeypatch.setenv("HETERO_PD_ADVERTISE_WAIT_S", "1")
    spec = DrillSpec(str(tiny_llama_dir), prefill=1, decode=1, ready_timeout_s=120, fork_pods=False)
    with pytest.raises(DrillError) as e:
        k8s_cluster(spec, dns={"decode-0": "prefill-0"})
    text = str(e.value)
    assert "pod drill-decode-0 (decode-0) exited with code 2" in text
    assert "worker decode-0 advertises drill-decode-0.drill-decode.default.svc" in text
    assert "but it binds" in text and "where it does not listen" in text
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"hpd-{__import__('os').getpid()}-" not in netns  # the failed drill left nothing

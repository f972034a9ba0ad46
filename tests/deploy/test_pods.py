"""A rendered pod as a process: the container's command, args and env parsed from the
manifests (not retyped), Kubernetes' `$(VAR)` expansion, and its volumes as mounts."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from hetero_pd.deploy import k8s, pods
from hetero_pd.deploy.k8s_secrets import SecretValues
from hetero_pd.deploy.schema import load_deployment
from hetero_pd.secrets import WorkerCredential

CONFIG = """
version: 1
model: /models/tiny
workers:
  - {role: prefill}
  - {role: decode, count: 2}
router: {port: 8000}
kubernetes: {name: lab, model_pvc: weights}
"""


def test_a_worker_pod_runs_its_containers_exact_command(
    write_yaml: Callable[[str], Path], tmp_path: Path
) -> None:
    dep = load_deployment(write_yaml(CONFIG))
    manifests = k8s.render(dep, SecretValues("the-deployment-secret", ("key-1",)))
    image_env = {"PATH": "/usr/bin", "HOME": "/tmp"}
    pod = pods.pod_process(
        manifests, "lab-decode", "lab-decode-1", "10.9.0.4", tmp_path, {"weights": "/w"}, image_env
    )
    (sts,) = [
        m for m in manifests if m["metadata"]["name"] == "lab-decode" and "template" in m["spec"]
    ]
    container = sts["spec"]["template"]["spec"]["containers"][0]
    written = [*container["command"], *container.get("args", [])]
    assert pod.argv[1:] == [
        part.replace("$(POD_NAME)", "lab-decode-1").replace("$(POD_IP)", "10.9.0.4")
        for part in written[1:]
    ]
    assert Path(pod.argv[0]).name in ("hetero-pd", Path(sys.executable).name)
    credential = WorkerCredential.for_group(b"the-deployment-secret", "decode").text()
    assert pod.env["HETERO_PD_WORKER_KEY"] == credential and "HETERO_PD_API_KEY" not in pod.env
    assert "HETERO_PD_SECRET" not in pod.env
    assert pod.env["POD_NAME"] == "lab-decode-1" and pod.env["POD_IP"] == "10.9.0.4"
    assert pod.env["HETERO_PD_CACHE_DIR"] == k8s.MODEL_DIR and pod.env["HOME"] == "/tmp"
    assert pod.component == "decode"
    assert pod.entry == pods.ENTRY  # the installed command: a lab may fork it (Lab.spawn)
    mounts = {m.target: m for m in pod.mounts}
    config = mounts[k8s.k8s_pods.CONFIG_DIR]
    assert config.read_only and (Path(config.source) / "deployment.yaml").read_text() == (
        write_yaml(CONFIG).read_text()
    )
    assert (mounts["/models"].source, mounts["/models"].read_only) == ("/w", True)
    assert mounts["/dev/shm"].source == ""  # memory-backed: a tmpfs of its own
    assert Path(mounts["/tmp"].source).is_dir() and mounts["/tmp"].source.startswith(str(tmp_path))
    router = pods.pod_process(
        manifests, "lab-router", "lab-router-0", "10.9.0.2", tmp_path, {"weights": "/w"}, {}
    )
    assert router.env["HETERO_PD_API_KEY"] == "key-1"
    with pytest.raises(ValueError, match="no folder given for claim 'weights'"):
        pods.pod_process(manifests, "lab-prefill", "lab-prefill-0", "10.9.0.3", tmp_path, {}, {})


def test_variable_expansion_follows_kubernetes() -> None:
    env = {"A": "x", "B": "$(A)"}
    assert pods.expand("--id=$(A)-$(B)", env) == "--id=x-$(A)"  # one pass, as Kubernetes
    assert pods.expand("$(MISSING) $$(A) $$", env) == "$(MISSING) $(A) $"


def test_only_this_installations_hetero_pd_command_is_forked_by_its_entry_point() -> None:
    """What `hetero-pd` runs (pyproject.toml's [project.scripts]) is what a forked pod
    calls; any other program is exec'd, as it is written."""
    assert pods.entry_point(pods.local_command(["hetero-pd", "serve", "x.yaml"])) == pods.ENTRY
    assert pods.entry_point([sys.executable, "-m", "hetero_pd.cli", "serve"]) == pods.ENTRY
    assert pods.entry_point([sys.executable, "-m", "hetero_pd.serving.worker.main"]) == ""
    assert pods.entry_point(pods.local_command(["sh", "-c", "hetero-pd"])) == ""
    assert pods.entry_point(["/elsewhere/bin/hetero-pd", "serve"]) == ""


def test_an_unknown_program_is_an_error() -> None:
    with pytest.raises(FileNotFoundError, match="'no-such-tool-here'"):
        pods.local_command(["no-such-tool-here", "x"])

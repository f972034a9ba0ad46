"""Each worker holds the material of itself alone (or, on Kubernetes, of its role's
StatefulSet): its control key pair and SSD-tier key derive from it, the router derives every
worker's public key from the deployment secret, and no worker's material gives another's."""

from __future__ import annotations

import pytest

from hetero_pd import secrets
from hetero_pd.serving.control.auth import RouterKeys, WorkerKeys

SECRET = b"a-deployment-secret-of-32-bytes!"


def test_each_worker_proves_its_own_key_and_the_router_expects_exactly_it() -> None:
    router = RouterKeys.from_secret(SECRET)
    ids = ["prefill-0", "prefill-1", "decode-0", "decode-10", "both", "a/b-1"]
    keys = {w: WorkerKeys.from_secret(SECRET, w) for w in ids}
    assert len({k.server_public for k in keys.values()}) == len(ids)
    for w, k in keys.items():
        assert router.worker_public(w) == k.server_public
        assert k.router_public == router.client_public
    disk = {secrets.WorkerCredential.for_worker(SECRET, w).key("kv-disk") for w in ids}
    assert len(disk) == len(ids)


def test_a_group_credential_covers_its_roles_workers_only() -> None:
    group = secrets.WorkerCredential.for_group(SECRET, "decode")
    for w in ("decode-0", "decode-7", "decode-123"):
        narrowed = group.narrow(w)
        assert narrowed == secrets.WorkerCredential.for_worker(SECRET, w)
        assert WorkerKeys.of(narrowed).server_public == RouterKeys.from_secret(
            SECRET
        ).worker_public(w)
    for w in ("prefill-0", "decode", "decode-x", "decode-1-2", "xdecode-1"):
        assert not group.covers(w)
        with pytest.raises(secrets.SecretError, match=w):
            group.narrow(w)
    with pytest.raises(secrets.SecretError, match="narrowed"):
        group.key("control/worker")  # a group's material is no worker's key


def test_a_worker_credential_runs_only_its_own_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    mine = secrets.WorkerCredential.for_worker(SECRET, "decode-0")
    monkeypatch.setenv(secrets.WORKER_ENV, mine.text())
    assert secrets.worker_credential_from_env("decode-0") == mine
    with pytest.raises(secrets.SecretError, match="none is worker 'decode-1'"):
        secrets.worker_credential_from_env("decode-1")
    # a host of two workers is given both, and each takes its own
    theirs = secrets.WorkerCredential.for_worker(SECRET, "prefill-3")
    monkeypatch.setenv(secrets.WORKER_ENV, f"{mine.text()},{theirs.text()}")
    assert secrets.worker_credential_from_env("prefill-3") == theirs
    assert secrets.parse_credentials(f"{mine.text()},{theirs.text()}") == [mine, theirs]


def test_a_credential_of_the_shared_kind_is_refused_with_what_to_do() -> None:
    old = "hpdw1.AAAA.BBBB"
    with pytest.raises(secrets.SecretError, match=r"python -m hetero_pd\.secrets WORKER_ID"):
        secrets.WorkerCredential.parse(old)


def test_ids_that_concatenate_alike_get_different_keys() -> None:
    a = secrets.WorkerCredential.for_worker(SECRET, "a-1")
    assert a.material != secrets.WorkerCredential.for_worker(SECRET, "a1").material
    root = secrets.workers_root(SECRET)
    assert secrets.group_material(root, "a") != secrets.group_material(root, "a-1")


def test_the_command_prints_credentials_from_the_secret(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(secrets.ENV, SECRET.decode())
    assert secrets.main(["decode-0", "prefill-1"]) == 0
    printed = secrets.parse_credentials(capsys.readouterr().out)
    assert [(c.scope, c.name) for c in printed] == [("worker", "decode-0"), ("worker", "prefill-1")]
    assert secrets.main(["--group", "decode"]) == 0
    (group,) = secrets.parse_credentials(capsys.readouterr().out)
    assert group == secrets.WorkerCredential.for_group(SECRET, "decode")
    assert secrets.main([]) == 2  # names are required: no credential for every worker

"""The multi-host drill on the rendered Kubernetes manifests: a router, two prefill and one
decode "pod", each on a host of its own, running exactly its container's command; the
client on another host, through the official openai client. Then kill -9 under load,
replacement, scale-up. The tests run in file order on one cluster."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hetero_pd.deploy import drill_client
from hetero_pd.deploy.drill import Cluster, DrillSpec, add_worker, k8s_cluster
from hetero_pd.deploy.drill_client import Answer, sequential, transferred_cleanly, under_load
from hetero_pd.deploy.testing import random_prompts

pytestmark = [pytest.mark.usefixtures("netns_ok"), pytest.mark.timeout(420)]
Texts = Callable[[list[list[int]], int], list[str]]
LONG, SHORT, TOKENS = 120, 20, 12  # prompts over 32 tokens are prefilled remotely


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir: Path) -> Iterator[Cluster]:
    c = k8s_cluster(DrillSpec(str(tiny_llama_dir)))
    try:
        yield c
    finally:
        c.close()


def _check(answers: list[Answer], expected: list[str]) -> None:
    for answer, want in zip(answers, expected, strict=True):
        assert not answer.error and answer.text == want, answer


def _all_transferred(rows: list[dict[str, Any]]) -> None:
    """Each request was prefilled remotely and its KV crossed the link, with no failed
    transfer, no retry, no recomputation and no wait for a timeout."""
    for row in rows:
        assert transferred_cleanly(row), {k: v for k, v in row.items() if k != "answer"}


def test_greedy_output_equals_the_single_process_engine(
    cluster: Cluster, tiny_texts: Texts
) -> None:
    prompts = random_prompts([LONG, LONG, SHORT], seed=11)
    expected = tiny_texts(prompts, TOKENS)
    for stream in (False, True):
        answers = [cluster.call(cluster.api.complete, p, TOKENS, stream) for p in prompts]
        _check(answers, expected)
    rows = cluster.call(sequential, cluster.api, prompts[:2], TOKENS)
    _check([r["answer"] for r in rows], expected[:2])
    _all_transferred(rows)  # round robin: once through each prefill host


def test_the_api_wants_its_key_from_the_secret(cluster: Cluster) -> None:
    status, _ = cluster.call(cluster.api.get, "/v1/models")
    assert status == 200
    anonymous = drill_client.Api(cluster.api.url, "", cluster.api.model)
    status, body = cluster.call(anonymous.get, "/v1/models")
    assert status == 401, body


def test_a_prefill_pod_killed_under_load(cluster: Cluster, tiny_texts: Texts) -> None:
    prompts = random_prompts([LONG] * 16, seed=12)
    expected = tiny_texts(prompts, TOKENS)
    before, recomputed = cluster.pids(), _recomputed(cluster)
    kill = lambda: cluster.kill("prefill-0")  # noqa: E731
    answers = cluster.call(under_load, cluster.api, prompts, TOKENS, 4, kill)
    # Requests sent to the dead worker before the router noticed were recomputed on the
    # decode worker (failure_policy: recompute): every answer is still right.
    _check(answers, expected)
    assert _recomputed(cluster) > recomputed
    cluster.run("prefill-0")  # the kubelet starts the container again
    cluster.wait_workers({"prefill-0"}, pids=before)
    rows = cluster.call(sequential, cluster.api, prompts[:4], TOKENS)
    _check([r["answer"] for r in rows], expected[:4])
    _all_transferred(rows)  # round robin: twice through the replaced pod


def test_a_decode_pod_killed_under_load(cluster: Cluster, tiny_texts: Texts) -> None:
    prompts = random_prompts([LONG] * 4, seed=14)
    before = cluster.pids()
    kill = lambda: cluster.kill("decode-0")  # noqa: E731
    answers = cluster.call(under_load, cluster.api, prompts, 256, 4, kill)
    # The only decode worker died mid-stream: each request ends with a clear error (the
    # client's timeout bounds them all: nothing hangs).
    assert all("decode-0" in a.error and "died" in a.error for a in answers), answers
    late = cluster.call(cluster.api.complete, prompts[0], TOKENS, False)
    assert "503" in late.error or "decode" in late.error, late  # refused, not queued forever
    cluster.run("decode-0")
    cluster.wait_workers({"decode-0"}, pids=before)


def test_a_replaced_decode_pod_takes_transfers_without_a_timeout(
    cluster: Cluster, tiny_texts: Texts
) -> None:
    """A decode pod killed and started again (a new process at the same name): the first
    transfers into it go through at once, not after a timeout on the old session."""
    before = cluster.pids()
    cluster.kill("decode-0")
    cluster.run("decode-0")
    cluster.wait_workers({"decode-0"}, pids=before)
    prompts = random_prompts([LONG] * 4, seed=15)
    rows = cluster.call(sequential, cluster.api, prompts, TOKENS)  # all to the new decode-0
    _check([r["answer"] for r in rows], tiny_texts(prompts, TOKENS))
    _all_transferred(rows)


def test_a_decode_scale_up_is_seen_by_the_router(cluster: Cluster, tiny_texts: Texts) -> None:
    add_worker(cluster, "decode-1")  # kubectl scale: a new pod, a new DNS record
    cluster.wait_workers({"decode-0", "decode-1"})
    prompts = random_prompts([LONG] * 2, seed=13)
    rows = cluster.call(sequential, cluster.api, prompts, TOKENS)
    _check([r["answer"] for r in rows], tiny_texts(prompts, TOKENS))
    _all_transferred(rows)


def test_worker_ports_ignore_a_peer_without_the_secret(cluster: Cluster) -> None:
    ip = cluster.lab.hosts["decode-0"].address  # an outsider on the network, without DNS
    address = f"tcp://{ip}:{cluster.dep.kubernetes.base_port}"
    assert cluster.call(drill_client.anonymous_hello, address) is None


def _recomputed(cluster: Cluster) -> float:
    return cluster.call(lambda: cluster.api.metric(drill_client.DECISIONS, decision="recompute"))

"""A supervised 2P1D CPU deployment under load: kill -9 a prefill worker, the supervisor
restarts it, requests keep being served; after SIGTERM no process of the deployment is left.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from hetero_pd.deploy.status import fetch_health, format_status
from hetero_pd.deploy.testing import ServeProcess, serve_process

#: Generous: on two cores shared with other work, three workers took over 60 s to start.
DEADLINE_S = 180.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes (its parent has not reaped it yet)
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _wait_for(what: str, check: Callable[[], bool], timeout_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _complete(url: str, model: str, prompt: list[int]) -> int:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0})
    req = urllib.request.Request(
        f"{url}/v1/completions", body.encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            json.loads(r.read())
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


class Load:
    """Threads sending completions until stopped; every status code is kept."""

    def __init__(self, url: str, model: str, threads: int = 3) -> None:
        self.url, self.model, self.stop = url, model, threading.Event()
        self.codes: list[int] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(threads)]
        for t in self._threads:
            t.start()

    def _run(self, n: int) -> None:
        i = 0
        while not self.stop.is_set():
            prompt = [(7 * n + 3 * i + k) % 500 + 1 for k in range(48)]  # > local prefill limit
            code = _complete(self.url, self.model, prompt)
            with self._lock:
                self.codes.append(code)
            i += 1

    def count(self) -> int:
        with self._lock:
            return len(self.codes)

    def join(self) -> None:
        self.stop.set()
        for t in self._threads:
            t.join(60)


@pytest.fixture
def deployment_file(tmp_path: Path, tiny_llama_dir: Path) -> Path:
    path = tmp_path / "2p1d.yaml"
    path.write_text(
        f"""
version: 1
model: {tiny_llama_dir}
router: {{host: 127.0.0.1, port: 0, failure_policy: recompute, local_prefill_max_tokens: 8}}
workers:
  - {{role: prefill, count: 2}}
  - {{role: decode}}
engine: {{num_threads: 1, max_num_seqs: 16, num_kv_blocks: 256, max_model_len: 512}}
supervisor: {{backoff_s: 0.2, stop_grace_s: 3}}
"""
    )
    return path


@pytest.fixture
def served(deployment_file: Path) -> Iterator[tuple[ServeProcess, str]]:
    with serve_process([str(deployment_file)], DEADLINE_S) as served:
        yield served


def _workers(url: str) -> dict[str, Any]:
    return fetch_health(url)[1]["workers"]


@pytest.mark.timeout(420)  # its waits have DEADLINE_S each; a busy CI box is slow
def test_killed_worker_is_restarted_under_load_and_sigterm_leaves_nothing(
    served: tuple[ServeProcess, str], tiny_llama_dir: Path
) -> None:
    proc, url = served
    workers = _workers(url)
    assert {w: (v["role"], v["device"]) for w, v in workers.items()} == {
        "prefill-0": ("prefill", "cpu"),
        "prefill-1": ("prefill", "cpu"),
        "decode-0": ("decode", "cpu"),
    }
    pids = {w: v["pid"] for w, v in workers.items()}
    load = Load(url, str(tiny_llama_dir))
    try:
        _wait_for("some requests", lambda: load.count() >= 6)
        os.kill(pids["prefill-0"], signal.SIGKILL)
        _wait_for("prefill-0 restarted", lambda: _restarted(url, pids["prefill-0"]))
        served_before = load.count()
        _wait_for("requests after the restart", lambda: load.count() >= served_before + 6)
    finally:
        load.join()
    after = _workers(url)
    assert after["prefill-0"]["restarts"] == 1 and after["prefill-0"]["alive"]
    assert "prefill-0" in format_status(fetch_health(url)[1])
    assert load.codes and set(load.codes) == {200}, load.codes
    every_pid = {proc.pid, *pids.values(), *(v["pid"] for v in after.values())}
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    _wait_for("every process gone", lambda: not any(_alive(p) for p in every_pid), 15)


def _restarted(url: str, old_pid: int) -> bool:
    w = _workers(url).get("prefill-0")  # absent while its new process says hello
    return w is not None and bool(w["alive"]) and w["pid"] != old_pid

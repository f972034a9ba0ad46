"""Workers forked from the fork server (`supervisor.fork_server`) behave as `python -m` ones:
served token for token as the engine, each in its own session with the request's stdio and no
descriptor of the server's, an exit code the supervisor sees (a SIGKILL is -9, then a restart
through the server), SIGTERM drains them to exit 0, and they stop when their launcher dies."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path

import openai
import pytest

from hetero_pd import LLM, SamplingParams, envs, secrets
from hetero_pd.deploy import forkserver
from hetero_pd.deploy.launcher import forks
from hetero_pd.deploy.status import fetch_health
from hetero_pd.deploy.testing import ServeProcess, deployment, running_stack, serve_process

PROMPT = [(5 * k) % 500 + 1 for k in range(40)]  # > local_prefill_max_tokens: P -> D


def _wait_for(what: str, check: Callable[[], bool], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _status(pid: int) -> tuple[str, int]:
    """(state, parent pid) from /proc/PID/stat; ("gone", 0) once it is reaped."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return "gone", 0
    return fields[0], int(fields[1])


def _environ(pid: int) -> set[str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return {e.split(b"=", 1)[0].decode() for e in raw if b"=" in e}


def _fds(pid: int) -> dict[int, str]:
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed since it was listed
            out[int(fd)] = os.readlink(f"/proc/{pid}/fd/{fd}")
    return out


@pytest.mark.parametrize(
    ("setting", "env", "expected"),
    [
        (None, "1", True),
        (None, "0", False),
        (None, "", False),
        (None, None, False),
        (False, "1", False),  # what a deployment says wins
        (True, "0", True),
        (True, None, True),
    ],
)
def test_the_deployment_decides_and_the_variable_only_where_it_is_silent(
    monkeypatch: pytest.MonkeyPatch, setting: bool | None, env: str | None, expected: bool
) -> None:
    if env is None:
        monkeypatch.delenv(envs.FORK_SERVER, raising=False)
    else:
        monkeypatch.setenv(envs.FORK_SERVER, env)
    supervisor = {} if setting is None else {"fork_server": setting}
    dep = deployment("m", supervisor=supervisor)
    assert dep.supervisor.fork_server is setting
    assert forks(dep.supervisor) is expected


def test_a_fork_server_variable_other_than_0_or_1_is_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(envs.FORK_SERVER, "yes")
    with pytest.raises(ValueError, match="HETERO_PD_FORK_SERVER must be '0' or '1', got 'yes'"):
        forks(deployment("m").supervisor)


def test_forked_workers_serve_exit_and_restart_as_spawned_ones(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Forked because the variable says so: the deployment does not."""
    monkeypatch.setenv(envs.FORK_SERVER, "1")
    params = SamplingParams(temperature=0, max_tokens=8)
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64, num_threads=1)
    expected = llm.generate([PROMPT], params)[0].outputs[0].text
    del llm
    dep = deployment(tiny_llama_dir, supervisor={"backoff_s": 0.1})
    with running_stack(dep) as s:
        assert s.launcher is not None
        client = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0, timeout=60)

        def served() -> str:
            r = client.completions.create(
                model=dep.model, prompt=PROMPT, max_tokens=8, temperature=0
            )
            return r.choices[0].text

        assert served() == expected
        pids = s.launcher.pids()
        server = _status(pids["prefill-0"])[1]
        assert server not in (0, os.getpid()) and _status(pids["decode-0"])[1] == server
        assert {w.config.parent_pid for w in s.launcher.procs.values()} == {server}
        assert not _environ(server) & {secrets.ENV, secrets.WORKER_ENV}
        server_fds = set(_fds(server).values()) - set(_fds(os.getpid()).values())
        for pid in pids.values():
            assert os.getsid(pid) == pid  # its own session, as start_new_session
            fds = _fds(pid)
            assert fds[2] == os.readlink("/proc/self/fd/2")  # its log goes where ours does
            assert not server_fds & set(fds.values()), "a worker holds the fork server's fds"

        old = s.launcher.procs["decode-0"].proc
        os.kill(old.pid, signal.SIGKILL)
        _wait_for("decode-0's exit code", lambda: old.returncode is not None)
        assert old.returncode == -signal.SIGKILL
        _wait_for("decode-0 restarted", lambda: s.launcher.pids()["decode-0"] != old.pid)
        _wait_for("decode-0 in rotation", lambda: s.router.workers["decode-0"].alive)  # type: ignore[union-attr]
        assert served() == expected
        s.wait_idle()
        procs = [w.proc for w in s.launcher.procs.values()]
    assert [p.returncode for p in procs] == [0, 0]  # drained on SIGTERM, exited cleanly


def test_the_fork_server_refuses_a_request_without_its_descriptors() -> None:
    # Refusing is the server's own work, done before any fork: it need not import the
    # worker (torch, ~3 s of CPU) to show it, so it preloads a module that imports nothing.
    server = forkserver.ForkServer(dict(os.environ), preload=("hetero_pd.process_exit",))
    try:
        with pytest.raises(RuntimeError, match="refused: a Spawn with 4 descriptors, got 1"):
            r, w = os.pipe()
            try:
                server.spawn({}, [r])
            finally:
                os.close(r)
                os.close(w)
        with server.lock:  # and a body that is not a Spawn
            socket.send_fds(server.sock, [b"\x93not a spawn"], [0, 1, 2, 2])
            assert b"Refused" in server.sock.recv(1 << 16)
    finally:
        server.sock.close()  # its launcher hangs up: it exits
        assert server.proc.wait(60) == 0


def test_forked_workers_stop_when_their_launcher_is_killed(
    tmp_path: Path, tiny_llama_dir: Path
) -> None:
    path = tmp_path / "forked.yaml"
    path.write_text(
        f"""
version: 1
model: {tiny_llama_dir}
router: {{host: 127.0.0.1, port: 0}}
workers: [{{role: both}}]
engine: {{num_threads: 1, num_kv_blocks: 64, max_model_len: 256}}
supervisor: {{fork_server: true}}
"""
    )
    proc: ServeProcess
    with serve_process([str(path)], 180.0) as (proc, url):
        worker = fetch_health(url)[1]["workers"]["both-0"]["pid"]
        server = _status(worker)[1]
        assert _status(server)[1] == proc.pid
        proc.kill()
        proc.wait(10)
        for pid in (server, worker):
            _wait_for(f"pid {pid} to exit", lambda pid=pid: _status(pid)[0] in ("gone", "Z"), 60)

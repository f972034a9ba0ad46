"""Programs forked from a fork server (`hetero_pd.deploy.forkserver`) for callers that are
not an event loop: a network-namespace lab's pods (`hetero_pd.deploy.netns`) and the test
helpers' `hetero-pd serve` (`hetero_pd.deploy.testing.serve_process`). Each such process
runs an entry point ("module:function", what its command would run) with its command's
argv and its exact environment; the server imported the entry's modules once, so it skips
an interpreter's start (~3 s of CPU importing torch and our modules)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import threading
from collections.abc import Sequence
from typing import Any

from hetero_pd.deploy.forkserver import LOAD_TIME_PREFIXES, STATUS, ForkServer

Servers = dict[tuple[Any, ...], ForkServer]
_servers: Servers = {}
_servers_lock = threading.Lock()


def program_server(
    env: dict[str, str], preload: Sequence[str], servers: Servers | None = None
) -> ForkServer:
    """The fork server (in `servers`, else this process's own) for programs with `env`,
    having imported `preload`: one per set of `env`'s LOAD_TIME_PREFIXES values, started on
    first use (again if it died) with those values and PATH only, no other variable (no
    secret). It ends when this process closes its socket or exits."""
    loaded = {k: v for k, v in env.items() if k.startswith(LOAD_TIME_PREFIXES)}
    key = (tuple(sorted(loaded.items())), tuple(preload))
    with _servers_lock:
        cache = _servers if servers is None else servers
        server = cache.get(key)
        if server is None or server.proc.poll() is not None:
            path = {"PATH": env.get("PATH", os.defpath)}
            server = cache[key] = ForkServer({**path, **loaded}, key[1])
        return server


class ForkedPod:
    """A process forked by a fork server, as `subprocess.Popen` shows one to a caller that
    is not an event loop (`hetero_pd.deploy.netns.Lab`): pid, returncode, poll, wait."""

    def __init__(self, pid: int, status_fd: int, args: list[str]):
        self.pid, self.args = pid, args
        self.returncode: int | None = None
        self._status = status_fd

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._status], [], [], 0)[0]:
            self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code; raises subprocess.TimeoutExpired after `timeout` seconds."""
        if self.returncode is None:
            if not select.select([self._status], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._read_status()
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read_status(self) -> None:
        data = os.read(self._status, STATUS.size)
        os.close(self._status)
        # the server died before reaping it: no exit code to tell, only that it is gone
        self.returncode = STATUS.unpack(data)[0] if len(data) == STATUS.size else 255


def fork_program(server: ForkServer, env: dict[str, str], output: int, **program: Any) -> ForkedPod:
    """A process forked by `server` with `env`, stdin from /dev/null, stdout and stderr to
    descriptor `output`; `program`: Spawn's netns, setup, entry and argv."""
    st_r, st_w = os.pipe()
    null = os.open(os.devnull, os.O_RDONLY)
    try:
        pid = server.spawn(env, [null, output, output, st_w], **program)
    except BaseException:
        os.close(st_r)
        raise
    finally:
        os.close(null)
        os.close(st_w)
    return ForkedPod(pid, st_r, list(program.get("argv", [])))

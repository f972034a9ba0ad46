"""A real serving stack for tests and drills: `serve()` (router, REST API and worker
processes) on its own event loop in a background thread, bounded in time, always torn down.

    with running_stack(deployment(model_dir)) as stack:
        client = stack.client()                      # the official openai client
        stack.call(stack.router.workers["decode-0"].check_integrity())  # on the stack's loop

Closing the stack checks that every worker process it started is gone (and kills any that
is not, so a failing test leaves no orphan behind).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import os
import random
import re
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Coroutine, Iterable, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

import msgspec

from hetero_pd.deploy import forked_programs, pods
from hetero_pd.deploy.launcher import Launcher
from hetero_pd.deploy.schema import Deployment, parse_deployment
from hetero_pd.deploy.serve import serve
from hetero_pd.serving.router.router import Router

T = TypeVar("T")
#: Small, fast engines: one thread each (tests share two cores), an exact block count.
SMALL_ENGINE: dict[str, Any] = {
    "num_threads": 1,
    "max_num_seqs": 32,
    "max_num_batched_tokens": 512,
    "num_kv_blocks": 256,
    "max_model_len": 1024,
}


def deployment(
    model: str | Path,
    workers: list[dict[str, Any]] | None = None,
    router: dict[str, Any] | None = None,
    transfer: dict[str, Any] | None = None,
    engine: dict[str, Any] | None = None,
    edge: dict[str, Any] | None = None,
    supervisor: dict[str, Any] | None = None,
) -> Deployment:
    """A deployment on 127.0.0.1 and a free port; 1 prefill + 1 decode worker by default."""
    raw: dict[str, Any] = {
        "model": str(model),
        "workers": workers or [{"role": "prefill"}, {"role": "decode"}],
        # Exact flows by default (a test that counts decisions needs them); tests of elastic
        # prefill turn it on.
        "router": {"host": "127.0.0.1", "port": 0, "elastic_prefill": False, **(router or {})},
        "transfer": transfer or {},
        "engine": {**SMALL_ENGINE, **(engine or {})},
    }
    if edge is not None:
        raw["edge"] = {"port": 0, **edge}  # TLS on any free port: tests run side by side
    if supervisor is not None:
        raw["supervisor"] = supervisor
    return parse_deployment(raw, "<test>")


class Stack:
    """A running deployment; see the module docstring."""

    def __init__(self, dep: Deployment) -> None:
        self.dep = dep
        self.url = ""
        #: Edge sessions over TLS (`edge.tls`): their URL and the certificate to trust.
        self.edge_url = ""
        self.edge_ca: Path | None = None
        self.launcher: Launcher | None = None
        self.router: Router | None = None
        self.pids: dict[str, int] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._api_stopped = threading.Event()
        self._release: asyncio.Event | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="hetero-pd-stack", daemon=True)

    def start(self, timeout_s: float = 120.0) -> Stack:
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._ready.wait(0.05):
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"the stack did not start: {self._error!r}")
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"the stack did not start within {timeout_s}s")
        return self

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as e:
            self._error = e

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._release = asyncio.Event()

        async def on_ready(url: str, launcher: Launcher, router: Router) -> None:
            self.url, self.launcher, self.router = url, launcher, router
            self.pids = dict(launcher.pids())
            self._ready.set()

        async def on_api_stopped() -> None:
            self._api_stopped.set()
            assert self._release is not None
            await self._release.wait()

        def on_edge(url: str, cert: Path) -> None:
            self.edge_url, self.edge_ca = url, cert

        await serve(
            self.dep,
            on_ready=on_ready,
            stop=self._stop,
            on_api_stopped=on_api_stopped,
            on_edge=on_edge,
        )

    def stop_api(self, timeout_s: float = 30.0) -> None:
        """Stops the API as a shutdown does (requests in flight are cut after the grace
        period) and returns with the workers still running, until close()."""
        self._set_soon(self._stop)
        if not self._api_stopped.wait(timeout_s):
            raise AssertionError(f"the API did not stop within {timeout_s}s")

    def _set_soon(self, event: asyncio.Event | None) -> None:
        if self._loop is not None and event is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(event.set)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stops the stack; raises AssertionError if it or a worker process outlived it."""
        self._set_soon(self._stop)
        self._set_soon(self._release)
        self._thread.join(timeout_s)
        pids = dict(self.pids)
        if self.launcher is not None:
            pids.update(self.launcher.pids())
        left = wait_gone(pids.values(), 5.0)
        for pid in left:  # only processes this stack started
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self._thread.is_alive():
            raise AssertionError(f"the stack did not stop within {timeout_s}s")
        if left:
            raise AssertionError(f"worker processes {left} outlived the stack")

    # -- helpers -------------------------------------------------------------------------
    def edge_ssl(self) -> ssl.SSLContext:
        """A TLS context that trusts this stack's edge listener (`edge.tls`)."""
        assert self.edge_ca is not None, "this stack serves no edge listener"
        return ssl.create_default_context(cafile=str(self.edge_ca))

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def call(self, coro: Coroutine[Any, Any, T], timeout_s: float = 30.0) -> T:
        """Runs a coroutine on the stack's event loop (the router lives there)."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Starts a coroutine on the stack's event loop; its result comes in the future."""
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def integrity(self) -> dict[str, dict[str, Any]]:
        """`check_integrity()` of every worker still in the deployment."""
        assert self.router is not None
        workers = [w for w in self.router.workers.values() if not w.gone]
        return {
            w.worker_id: msgspec.structs.asdict(self.call(w.check_integrity())) for w in workers
        }

    def wait_idle(self, timeout_s: float = 20.0) -> dict[str, dict[str, Any]]:
        """Polls every live worker until its block pool is consistent, idle and empty."""
        deadline = time.monotonic() + timeout_s
        while True:
            report = self.integrity()
            if all(_idle(r) for r in report.values()):
                return report
            if time.monotonic() > deadline:
                raise AssertionError(f"workers not idle and empty after {timeout_s}s: {report}")
            time.sleep(0.05)

    def metrics(self) -> str:
        keys = self.dep.router.api_keys
        headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}
        req = urllib.request.Request(f"{self.url}/metrics", headers=headers)
        with urllib.request.urlopen(req, timeout=10) as resp:
            return str(resp.read().decode())

    def metric(self, name: str, **labels: str) -> float:
        return metric_value(self.metrics(), name, **labels)


def _idle(report: dict[str, Any]) -> bool:
    return bool(report["ok"]) and report["message"] == "idle" and report["used_blocks"] == 0


@contextlib.contextmanager
def running_stack(dep: Deployment, start_timeout_s: float = 120.0) -> Iterator[Stack]:
    stack = Stack(dep)
    try:
        yield stack.start(start_timeout_s)
    finally:
        stack.close()


def metric_value(text: str, name: str, **labels: str) -> float:
    """One sample of a Prometheus text exposition whose labels include `labels` (others,
    such as `model_name`, may be there too); 0.0 when it is absent."""
    want = {f'{k}="{v}"' for k, v in labels.items()}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$", line)
        if m is None or m.group(1) != name:
            continue
        if want <= {p for p in (m.group(2) or "").split(",") if p}:
            return float(m.group(3))
    return 0.0


def wait_gone(pids: Iterable[int], timeout_s: float) -> list[int]:
    """Polls until no process in `pids` exists; returns those still there at the deadline."""
    deadline = time.monotonic() + timeout_s
    left = list(pids)
    while left:
        left = [pid for pid in left if _exists(pid)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    return left


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def random_prompts(lengths: Iterable[int], seed: int, vocab: int = 512) -> list[list[int]]:
    """Token-id prompts of the given lengths (ids below `vocab`), reproducible by `seed`."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def http_json(
    url: str, body: Any = None, key: str | None = None, timeout_s: float = 60.0
) -> tuple[int, Any]:
    """GET (no body) or POST `body` as JSON, with `key` as the Bearer token; the status and
    the JSON answer, errors included."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


class Probe:
    """GETs or POSTs `url` over and over on a thread, recording each answer's latency; for
    tests that check the router stays responsive while it handles something expensive.

        with Probe(stack.url + "/health?live=1") as probe:
            ...                                   # the expensive request, answered
        assert probe.statuses == {200} and probe.worst_s < bound
    """

    def __init__(self, url: str, body: Any = None, key: str | None = None, min_calls: int = 3):
        self.url, self.body, self.key, self.min_calls = url, body, key, min_calls
        self.latencies: list[float] = []
        self.statuses: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hetero-pd-probe", daemon=True)

    def __enter__(self) -> Probe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(120)

    def _run(self) -> None:
        while not self._stop.is_set() or len(self.latencies) < self.min_calls:
            start = time.perf_counter()
            status, _ = http_json(self.url, self.body, self.key)
            self.latencies.append(time.perf_counter() - start)
            self.statuses.add(status)

    @property
    def worst_s(self) -> float:
        return max(self.latencies)


#: `hetero-pd serve` as `serve_process` starts it: a fresh process, or forked.
ServeProcess = subprocess.Popen[str] | forked_programs.ForkedPod


@contextlib.contextmanager
def serve_process(
    argv: list[str], timeout_s: float, env: dict[str, str] | None = None, fork: bool = True
) -> Iterator[tuple[ServeProcess, str]]:
    """`hetero-pd serve ARGV` as a user runs it (a process of its own, with exactly `env`,
    default ours); yields it and its base URL, read from its banner. Killed on exit unless
    the caller already stopped it. Forked (`fork`, the default) from this process's fork
    server for programs, which imported what `serve` imports once (`pods.PRELOAD`): the
    same entry point, arguments and environment as `python -m hetero_pd.cli serve ARGV`,
    which `fork=False` runs, without an interpreter importing torch again (~4 s of CPU)."""
    proc: ServeProcess
    if fork:
        full = dict(os.environ if env is None else env)
        server = forked_programs.program_server(full, pods.PRELOAD)
        read, write = os.pipe()
        try:
            command = ["hetero-pd", "serve", *argv]
            proc = forked_programs.fork_program(server, full, write, entry=pods.ENTRY, argv=command)
        finally:
            os.close(write)
        output: IO[str] = os.fdopen(read, "r", errors="replace")
    else:
        popen = subprocess.Popen(
            [sys.executable, "-m", "hetero_pd.cli", "serve", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        assert popen.stdout is not None
        proc, output = popen, popen.stdout
    url: list[str] = []
    ready = threading.Event()

    def read_lines() -> None:  # keeps draining its output so the server never blocks on it
        with output:
            for line in output:
                m = re.search(r"serving .* at (http://\S+)/v1", line)
                if m and not url:
                    url.append(m.group(1))
                    ready.set()

    threading.Thread(target=read_lines, daemon=True).start()
    try:
        assert ready.wait(timeout_s), f"hetero-pd serve {' '.join(argv)} did not come up"
        yield proc, url[0]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)

"""Workers forked from a process that imported them once (`supervisor.fork_server`).

A worker started as `python -m hetero_pd.serving.worker.main` spends ~2.9 s of CPU importing
torch and our modules before it reads its config (docs/BENCHMARKS.md section 11). With the
switch on, the launcher starts one fork server per launcher process (and per environment
that native libraries read when they load), which imports all that once and then forks a
worker on each request:

  launcher ──Spawn + 4 fds (stdin, stdout, stderr, status pipe)──> fork server
     ▲                                                                │ fork()
     ├──── stdout pipe: the READY line ──── worker <──────────────────┘
     └──── status pipe: its exit code, when the fork server reaps it

A forked worker is what the `python -m` one is: its own session (process group), the
request's environment (the credential in it) and working directory, stdin/stdout/stderr as
given and no other descriptor, default signal handlers, Python's normal exit (atexit
handlers run). Its parent is the fork server, so the launcher tells the worker to watch the
server's pid, and the server exits when its launcher does (its socket ends): workers still
stop when their launcher dies. Safe to fork: the server runs no torch op, so no torch thread
pool or lock exists yet; it forks from its only Python thread (numpy's OpenBLAS pool stops
and restarts around fork by itself); it holds no socket but its own, which the child closes.
What differs from a fresh process: /proc/<pid>/environ and cmdline show the fork server's
(the credential is in the worker's os.environ only), and the hash seed is the server's.

A network-namespace lab (`hetero_pd.deploy.netns`) forks its pods from one too: a Spawn
with `entry` ("module:function", what the pod's command runs, with the command's argv) and
`netns` makes the child enter that host's namespaces (`netns_sys.enter_host`) first, and
the server imports the modules the lab names (`pods.PRELOAD`) instead of the worker's.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import msgspec

#: Variables that native libraries (OpenMP, MKL, OpenBLAS, torch, CUDA), the interpreter or
#: our modules (transfer.hashing's HETERO_PD_HASH_INLINE_BYTES) read when they load: a fork
#: server serves only requests whose values equal its own.
LOAD_TIME_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "TORCH", "PYTORCH_", "CUDA_",
                      "LD_", "PYTHON", "MALLOC_", "DNNL_", "ONEDNN_",
                      "HETERO_PD_HASH_")  # fmt: skip
#: What a fork server imports unless told otherwise, and runs in a child without `entry`.
WORKER = "hetero_pd.serving.worker.main"
STATUS = struct.Struct("<i")  # a child's exit code, as the server writes it
_MAX_MESSAGE = 1 << 20


class Spawn(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    """Fork a worker with this environment and working directory; or, with `entry`
    ("module:function"), a process that runs it as its program with `argv`, in network
    namespace `netns` and new mount and UTS namespaces set up by the shell script `setup`
    when `netns` is given (a lab's pod: `hetero_pd.deploy.netns`)."""

    env: dict[str, str]
    cwd: str
    netns: str = ""
    setup: str = ""
    entry: str = ""
    argv: list[str] = msgspec.field(default_factory=list)


class Spawned(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    pid: int


class Refused(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    error: str


_decode_request = msgspec.msgpack.Decoder(Spawn).decode
_decode_reply = msgspec.msgpack.Decoder(Spawned | Refused).decode
_encode = msgspec.msgpack.Encoder().encode


# -- the fork server's side --------------------------------------------------------------
def _serve(sock: socket.socket) -> Spawn | None:
    """Forks a worker per request until the launcher hangs up (None). Returns, in a forked
    child only, the request it is to become a worker for."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    status_fds: dict[int, int] = {}  # child pid -> its status pipe
    while True:
        for key, _ in sel.select():
            if key.fileobj == wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(wake_r, 4096)
                _reap(status_fds)
                continue
            data, fds, flags, _ = socket.recv_fds(sock, _MAX_MESSAGE, 4)
            if not data:
                return None
            try:
                if flags & socket.MSG_TRUNC or len(fds) != 4:
                    raise ValueError(f"a Spawn with 4 descriptors, got {len(fds)}")
                request = _decode_request(data)
            except (ValueError, msgspec.DecodeError) as e:
                for fd in fds:
                    os.close(fd)
                sock.send(_encode(Refused(error=str(e))))
                continue
            pid = os.fork()
            if pid == 0:  # the worker: leave the server's descriptors and handlers behind
                sel.close()
                sock.close()
                for fd in (wake_r, wake_w, *status_fds.values()):
                    os.close(fd)
                signal.set_wakeup_fd(-1)
                _become_worker(request, fds)
                return request
            status_fds[pid] = fds[3]
            for fd in fds[:3]:
                os.close(fd)
            sock.send(_encode(Spawned(pid=pid)))


def _reap(status_fds: dict[int, int]) -> None:
    """Reaps every exited child and writes its exit code (negative: the signal that ended
    it, as asyncio's returncode) into its status pipe."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        fd = status_fds.pop(pid, None)
        if fd is not None:
            with contextlib.suppress(OSError):  # the launcher stopped listening
                os.write(fd, STATUS.pack(os.waitstatus_to_exitcode(status)))
            os.close(fd)


def _become_worker(request: Spawn, fds: list[int]) -> None:
    """In the child: what a fresh `python -m` process would have."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.setsid()
    for target, fd in enumerate(fds[:3]):
        os.dup2(fd, target)
    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    numpy = sys.modules.get("numpy")
    if numpy is not None:  # its global generator would repeat the server's in every worker
        numpy.random.seed()


def main() -> int:
    """`python -m hetero_pd.deploy.forkserver FD [MODULE...]`: FD is its end of the
    launcher's socket; the MODULEs (default: the worker's) are imported before it serves."""
    sock = socket.socket(fileno=int(sys.argv[1]))
    from hetero_pd.process_exit import exit_after

    for module in sys.argv[2:] or [WORKER]:
        importlib.import_module(module)
    if threading.active_count() != 1:
        print(f"fork server: {threading.enumerate()} running after imports", file=sys.stderr)
        return 2
    request = _serve(sock)
    if request is None:
        return 0
    if request.netns:
        from hetero_pd.deploy.netns_sys import enter_host

        try:
            enter_host(request.netns, request.setup)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            print(f"fork server: {e}", file=sys.stderr, flush=True)
            os._exit(126)
    module, _, function = (request.entry or f"{WORKER}:main").partition(":")
    program = importlib.import_module(module)
    sys.argv = request.argv or [program.__file__ or module]
    exit_after(getattr(program, function))


# -- the launcher's side -----------------------------------------------------------------
class ForkServer:
    """A running fork server and the launcher's end of its socket."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...] = ()):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hetero_pd.deploy.forkserver", str(theirs.fileno()), *preload],
            pass_fds=[theirs.fileno()],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def spawn(self, env: dict[str, str], fds: list[int], **program: Any) -> int:
        """Forks a worker with `env` and fds (stdin, stdout, stderr, status); its pid. Blocks
        while the server still imports (the first request). `program`: Spawn's netns,
        setup, entry and argv."""
        request = Spawn(env=env, cwd=os.getcwd(), **program)
        with self.lock:
            socket.send_fds(self.sock, [_encode(request)], fds)
            reply = self.sock.recv(_MAX_MESSAGE)
        if not reply:
            raise RuntimeError(f"fork server (pid {self.pid}) exited with {self.proc.wait()}")
        answer = _decode_reply(reply)
        if isinstance(answer, Refused):
            raise RuntimeError(f"fork server refused: {answer.error}")
        return answer.pid


_servers: dict[tuple[tuple[str, str], ...], ForkServer] = {}
_servers_lock = threading.Lock()


def server_for(env: dict[str, str], secret_names: tuple[str, ...]) -> ForkServer:
    """This process's fork server for `env` (started on first use, again if it died): one
    per set of LOAD_TIME_PREFIXES values. It gets `env` without `secret_names`."""
    key = tuple(sorted((k, v) for k, v in env.items() if k.startswith(LOAD_TIME_PREFIXES)))
    with _servers_lock:
        server = _servers.get(key)
        if server is None or server.proc.poll() is not None:
            server = _servers[key] = ForkServer(
                {k: v for k, v in env.items() if k not in secret_names}
            )
        return server


class ForkedProcess:
    """A forked worker as the launcher and supervisor use an asyncio Process: pid,
    returncode, stdout, wait, send_signal, kill."""

    def __init__(self, pid: int, stdout: asyncio.StreamReader, status: asyncio.StreamReader):
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._status = asyncio.ensure_future(self._read_status(status))

    async def _read_status(self, status: asyncio.StreamReader) -> int:
        data = await status.read(STATUS.size)
        # the server died before reaping it: no exit code to tell, only that it is gone
        self.returncode = STATUS.unpack(data)[0] if len(data) == STATUS.size else 255
        return self.returncode

    async def wait(self) -> int:
        return await asyncio.shield(self._status)

    def send_signal(self, sig: int) -> None:
        if self.returncode is not None:
            raise ProcessLookupError(self.pid)
        os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


async def start_worker(
    env: dict[str, str], stdin: Callable[[int], bytes], secret_names: tuple[str, ...]
) -> tuple[ForkedProcess, int]:
    """A worker forked with `env`, given `stdin(pid of the fork server: its parent)`; the
    worker and that pid."""
    loop = asyncio.get_running_loop()
    server = await asyncio.to_thread(server_for, env, secret_names)
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    st_r, st_w = os.pipe()
    try:
        pid = await asyncio.to_thread(server.spawn, env, [in_r, out_w, 2, st_w])
    except BaseException:
        for fd in (in_w, out_r, st_r):
            os.close(fd)
        raise
    finally:
        for fd in (in_r, out_w, st_w):
            os.close(fd)
    proc = ForkedProcess(pid, await _reader(loop, out_r), await _reader(loop, st_r))
    await asyncio.to_thread(_write_and_close, in_w, stdin(server.pid))
    return proc, server.pid


async def _reader(loop: asyncio.AbstractEventLoop, fd: int) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    protocol = asyncio.StreamReaderProtocol(reader)
    await loop.connect_read_pipe(lambda: protocol, os.fdopen(fd, "rb", 0))
    return reader


def _write_and_close(fd: int, data: bytes) -> None:
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(fd, view) :]
    except BrokenPipeError:  # it exited before reading: its exit code will say so
        pass
    finally:
        os.close(fd)


if __name__ == "__main__":
    sys.exit(main())

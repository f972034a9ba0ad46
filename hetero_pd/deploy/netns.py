"""Several hosts on one Linux machine: network namespaces joined by a bridge.

    hub netns ─ bridge ─┬─ veth ─ eth0 of "router"     10.251.0.2   lo up
                        ├─ veth ─ eth0 of "prefill-0"  10.251.0.3   lo up
                        └─ veth ─ eth0 of "decode-0"   10.251.0.4   lo up

Nothing is added to the machine's own network: the bridge lives in a namespace of its own,
so two labs never see each other and the test range cannot clash with real routes. Each
host has its own addresses, ports and loopback, and a hosts file (`/etc/netns/<ns>/hosts`,
which `ip netns exec` mounts over `/etc/hosts`) standing in for cluster DNS. A process
started on a host (`Lab.spawn`) also gets its own mount and UTS namespaces: a private
`/dev/shm` (tmpfs), its own hostname, and the bind mounts it asks for, so nothing can reach
another "host" through shared memory or a shared path. Such a process is exec'd through
`ip netns exec` and `unshare`, or, when the caller names the Python entry point its command
runs (`entry`), forked from the lab's fork server (`hetero_pd.deploy.forkserver`), which
enters the same namespaces itself (`netns_sys.enter_host`): the same program, arguments and
environment, without an interpreter importing torch again for every process.

Everything a lab creates is named `hpd-<pid>-...` and removed by `close()` (also from
`atexit`); `sweep()` removes what labs of dead processes left behind.
"""

from __future__ import annotations

import atexit
import contextlib
import ipaddress
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol, TypeVar

from hetero_pd.deploy import forked_programs
from hetero_pd.deploy.netns_sys import (
    ETC_NETNS,
    PARK,
    PREFIX,
    STATE_DIR,
    enter_netns,
    is_alive,
    make_mount_point,
    netns_exec_steps,
    ns,
    release_state,
    remove,
    run,
    tool,
)

T = TypeVar("T")
TOOLS = ("ip", "unshare", "mount", "hostname", "sh")


def unavailable() -> str | None:
    """Why namespaces cannot be made here (not root, no `ip`, no `unshare`), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (run the drill as root, as CI does)"
    for name in TOOLS:
        if tool(name) == "":
            return f"`{name}` is not installed (iproute2 / util-linux)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    run(["ip", "netns", "del", probe], check=False)
    return None


class Proc(Protocol):
    """A process on a host: a `subprocess.Popen`, or a `forked_programs.ForkedPod` alike."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


@dataclass(frozen=True, slots=True)
class Host:
    """One "machine": a network namespace with one address on the lab's bridge."""

    name: str
    netns: str
    address: str


@dataclass(slots=True)
class Mount:
    """What a process on a host sees at `target`: a bind of `source`, or a fresh tmpfs."""

    target: str
    source: str = ""  # "" = tmpfs
    read_only: bool = False


@dataclass(slots=True)
class Lab:
    """A bridge and the hosts on it; see the module docstring."""

    subnet: str = "10.251.0.0/24"
    tag: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}")
    hosts: dict[str, Host] = field(default_factory=dict)
    #: DNS name -> address, as every host sees it; `overrides` changes it for one host.
    dns: dict[str, str] = field(default_factory=dict)
    overrides: dict[str, dict[str, str]] = field(default_factory=dict)
    procs: list[Proc] = field(default_factory=list)
    #: Fork servers of `spawn(entry=...)`, by load-time environment and preloaded modules.
    servers: forked_programs.Servers = field(default_factory=dict)
    _free: Iterator[ipaddress.IPv4Address] | None = None
    _closed: bool = False

    def __post_init__(self) -> None:
        reason = unavailable()
        if reason is not None:
            raise RuntimeError(reason)
        sweep()
        net = ipaddress.IPv4Network(self.subnet)
        self._free = net.hosts()
        next(self._free)  # .1 stays unused (no gateway: the lab has no way out)
        (STATE_DIR / str(os.getpid())).mkdir(parents=True, exist_ok=True)
        atexit.register(self.close)
        try:
            run(["ip", "netns", "add", self.hub])
            ns(self.hub, "ip", "link", "add", "br0", "type", "bridge")
            ns(self.hub, "ip", "link", "set", "br0", "up")
            ns(self.hub, "ip", "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Lab:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def hub(self) -> str:
        return f"{self.tag}-hub"

    @property
    def prefix_len(self) -> int:
        return ipaddress.IPv4Network(self.subnet).prefixlen

    def add_host(self, name: str) -> Host:
        """A new host on the bridge, with loopback up and the next free address."""
        assert self._free is not None and not self._closed
        if name in self.hosts:
            raise ValueError(f"host {name!r} exists already")
        host = Host(name, f"{self.tag}-{name}", str(next(self._free)))
        index = len(self.hosts)
        self.hosts[name] = host
        run(["ip", "netns", "add", host.netns])
        make_mount_point(str(ETC_NETNS), is_file=False)  # recorded if this lab made it
        (ETC_NETNS / host.netns).mkdir()
        port = f"p{index}"  # inside the hub namespace: short and unique there
        peer = ["peer", "name", "eth0", "netns", host.netns]
        run(["ip", "link", "add", port, "netns", self.hub, "type", "veth", *peer])
        ns(self.hub, "ip", "link", "set", port, "master", "br0")
        ns(self.hub, "ip", "link", "set", port, "up")
        ns(host.netns, "ip", "addr", "add", f"{host.address}/{self.prefix_len}", "dev", "eth0")
        ns(host.netns, "ip", "link", "set", "eth0", "up")
        ns(host.netns, "ip", "link", "set", "lo", "up")
        self.write_hosts()
        return host

    def write_hosts(self) -> None:
        """Every host's `/etc/hosts` from `dns` and its `overrides`, rewritten in place (the
        file is bind-mounted into running processes: a new inode would not be seen)."""
        for host in self.hosts.values():
            table = {**self.dns, **self.overrides.get(host.name, {})}
            lines = ["127.0.0.1 localhost", f"{host.address} {host.name}"]
            lines += [f"{address} {name}" for name, address in table.items()]
            path = ETC_NETNS / host.netns / "hosts"
            with open(path, "r+" if path.exists() else "w") as f:
                text = "\n".join(lines) + "\n"
                f.seek(0)
                f.write(text)
                f.truncate(len(text.encode()))

    def spawn(
        self,
        host: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        mounts: Sequence[Mount] = (),
        hostname: str = "",
        log: IO[bytes] | None = None,
        shm_bytes: int = 1 << 30,
        entry: str = "",
        preload: Sequence[str] = (),
    ) -> Proc:
        """Runs `argv` on `host` with exactly `env`, a private /dev/shm, its own hostname and
        `mounts`; a new session, so `kill_process_groups` ends it and all its children.
        With `entry` ("module:function", what `argv[0]` runs), the process is forked, with
        `argv` and `env`, from this lab's fork server, which imported `preload` once, instead
        of exec'd: the same program on the same host without an interpreter's start."""
        h = self.hosts[host]
        steps = _mount_steps(mounts, shm_bytes)
        steps.append(f"{tool('hostname')} {shlex.quote(hostname or host)}")
        if entry:
            proc: Proc = self._fork(h, argv, env, steps, log, entry, preload)
            self.procs.append(proc)
            return proc
        script = " && ".join(steps) + ' && exec "$@"'
        cmd = [tool("ip"), "netns", "exec", h.netns, tool("unshare"), "--uts", "--mount"]
        cmd += ["--propagation", "private", tool("sh"), "-c", script, "pod", *argv]
        proc = subprocess.Popen(
            cmd,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=log or subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def _fork(
        self,
        h: Host,
        argv: Sequence[str],
        env: Mapping[str, str],
        steps: list[str],
        log: IO[bytes] | None,
        entry: str,
        preload: Sequence[str],
    ) -> forked_programs.ForkedPod:
        """`argv` forked on host `h` (see `spawn`), from the fork server whose environment
        has `env`'s load-time values (`forkserver.LOAD_TIME_PREFIXES`), PATH and nothing else."""
        server = forked_programs.program_server(dict(env), preload, self.servers)
        script = " && ".join(netns_exec_steps(h.netns) + steps)
        with open(os.devnull, "wb") as null:
            output = (log or null).fileno()
            return forked_programs.fork_program(
                server, dict(env), output, netns=h.netns, setup=script, entry=entry, argv=argv
            )

    def call_in(self, host: str, fn: Callable[..., T], *args: Any, timeout_s: float = 300) -> T:
        """`fn(*args)` on a thread that lives in `host`'s network namespace: every socket it
        opens is that host's. Name lookups still read this process's /etc/hosts: use
        addresses."""
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                enter_netns(self.hosts[host].netns)
                box["value"] = fn(*args)
            except BaseException as e:
                box["error"] = e

        thread = threading.Thread(target=run, name=f"in-{host}", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            raise TimeoutError(f"{getattr(fn, '__name__', fn)} on {host} took over {timeout_s}s")
        if "error" in box:
            raise box["error"]
        value: T = box["value"]
        return value

    def pids(self, host: str) -> list[int]:
        """Every process inside `host`'s network namespace."""
        out = run(["ip", "netns", "pids", self.hosts[host].netns], check=False).stdout
        return [int(p) for p in out.split()]

    def close(self) -> None:
        """Ends every process on the lab's hosts and removes the namespaces and files."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        kill_process_groups(self.procs)
        for server in self.servers.values():
            server.sock.close()  # its launcher hangs up: it exits
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.proc.wait(10)
        names = [h.netns for h in self.hosts.values()] + [self.hub]
        remove(names)
        release_state(os.getpid())


def kill_process_groups(procs: Sequence[Proc], grace_s: float = 5.0) -> None:
    """SIGTERM to every session of `procs` at once, SIGKILL to those still running `grace_s`
    later, then all reaped: N pods stop within one grace period, not N of them one after
    another (and a pod whose exit waits on another's is not killed for it)."""
    pending = list(procs)
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        for proc in pending:
            _signal_group(proc, sig)
        deadline = time.monotonic() + wait
        still = []
        for proc in pending:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                still.append(proc)
                continue
            _signal_group(proc, signal.SIGKILL)  # children that outlived their parent
        pending = still
        if not pending:
            return


def _signal_group(proc: Proc, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def sweep() -> list[str]:
    """Removes namespaces and state left by labs whose process is gone; returns them."""
    listed = run(["ip", "netns", "list"], check=False).stdout.split("\n")
    stale = []
    for line in listed:
        name = line.split(" ")[0]
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX) :].split("-")[0]
        if pid.isdigit() and not is_alive(int(pid)):
            stale.append(name)
    remove(stale)
    if STATE_DIR.is_dir():
        for entry in STATE_DIR.iterdir():
            if entry.is_dir() and entry.name.isdigit() and not is_alive(int(entry.name)):
                release_state(int(entry.name))
    return stale


def _mount_steps(mounts: Sequence[Mount], shm_bytes: int) -> list[str]:
    """Shell steps that give a new mount namespace a private /dev/shm and `mounts`. A pod's
    /tmp emptyDir would hide a checkout or venv that lives under /tmp: they are parked on
    a tmpfs of this mount namespace and bound back over the new mount."""
    mount = tool("mount")
    steps = [f"{mount} -t tmpfs -o size={shm_bytes},mode=1777 shm /dev/shm"]
    keep = _hidden_by(mounts)
    if keep:
        make_mount_point(str(PARK), is_file=False)
        steps.append(f"{mount} -t tmpfs -o size=1m park {PARK}")
    for i, path in enumerate(keep):
        spot = shlex.quote(f"{PARK}/{i}")
        steps.append(f"{tool('mkdir')} {spot} && {mount} --bind {shlex.quote(path)} {spot}")
    for m in mounts:
        make_mount_point(m.target, bool(m.source) and Path(m.source).is_file())
        if m.source:
            steps.append(f"{mount} --bind {shlex.quote(m.source)} {shlex.quote(m.target)}")
            if m.read_only:
                steps.append(f"{mount} -o remount,bind,ro {shlex.quote(m.target)}")
        else:
            steps.append(f"{mount} -t tmpfs -o mode=1777 tmp {shlex.quote(m.target)}")
    for i, path in enumerate(keep):
        spot, where = shlex.quote(f"{PARK}/{i}"), shlex.quote(path)
        steps.append(f"{tool('mkdir')} -p {where} && {mount} --bind {spot} {where}")
        steps.append(f"{tool('umount')} {spot}")
    if keep:
        steps.append(f"{tool('umount')} {PARK}")
    return steps


def _hidden_by(mounts: Sequence[Mount]) -> list[str]:
    """The folders this Python and hetero_pd run from that one of `mounts` would cover."""
    import hetero_pd

    needed = {Path(sys.prefix), Path(hetero_pd.__file__).resolve().parents[1]}
    needed = {p for p in needed if not any(q in p.parents for q in needed)}
    covered = [Path(m.target) for m in mounts]
    return sorted(str(p) for p in needed if any(t == p or t in p.parents for t in covered))

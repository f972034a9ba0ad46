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
another "host" through shared memory or a shared path.

Everything a lab creates is named `hpd-<pid>-...` and removed by `close()` (also from
`atexit`); `sweep()` removes what labs of dead processes left behind.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ipaddress
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, TypeVar

T = TypeVar("T")
PREFIX = "hpd-"
NETNS_DIR = Path("/var/run/netns")
ETC_NETNS = Path("/etc/netns")
#: Labs alive now (one folder per pid) and the mount points they had to create.
STATE_DIR = Path("/run/hetero-pd-netns")
PARK = STATE_DIR / "park"  # where a process's software waits while a mount covers it
CLONE_NEWNET = 0x40000000
TOOLS = ("ip", "unshare", "mount", "hostname", "sh")
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def unavailable() -> str | None:
    """Why namespaces cannot be made here (not root, no `ip`, no `unshare`), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (run the drill as root, as CI does)"
    for tool in TOOLS:
        if _tool(tool) == "":
            return f"`{tool}` is not installed (iproute2 / util-linux)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = _run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    return None


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
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
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
            _run(["ip", "netns", "add", self.hub])
            _ns(self.hub, "ip", "link", "add", "br0", "type", "bridge")
            _ns(self.hub, "ip", "link", "set", "br0", "up")
            _ns(self.hub, "ip", "link", "set", "lo", "up")
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
        _run(["ip", "netns", "add", host.netns])
        _make_mount_point(str(ETC_NETNS), is_file=False)  # recorded if this lab made it
        (ETC_NETNS / host.netns).mkdir()
        port = f"p{index}"  # inside the hub namespace: short and unique there
        peer = ["peer", "name", "eth0", "netns", host.netns]
        _run(["ip", "link", "add", port, "netns", self.hub, "type", "veth", *peer])
        _ns(self.hub, "ip", "link", "set", port, "master", "br0")
        _ns(self.hub, "ip", "link", "set", port, "up")
        _ns(host.netns, "ip", "addr", "add", f"{host.address}/{self.prefix_len}", "dev", "eth0")
        _ns(host.netns, "ip", "link", "set", "eth0", "up")
        _ns(host.netns, "ip", "link", "set", "lo", "up")
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
    ) -> subprocess.Popen[bytes]:
        """Runs `argv` on `host` with exactly `env`, a private /dev/shm, its own hostname and
        `mounts`; a new session, so `kill_process_groups` ends it and all its children."""
        h = self.hosts[host]
        mount, sh = _tool("mount"), _tool("sh")
        steps = [f"{mount} -t tmpfs -o size={shm_bytes},mode=1777 shm /dev/shm"]
        # A pod's /tmp emptyDir would hide a checkout or venv that lives under /tmp: they
        # are parked on a tmpfs of this mount namespace and bound back over the new mount.
        keep = _hidden_by(mounts)
        if keep:
            _make_mount_point(str(PARK), is_file=False)
            steps.append(f"{mount} -t tmpfs -o size=1m park {PARK}")
        for i, path in enumerate(keep):
            spot = shlex.quote(f"{PARK}/{i}")
            steps.append(f"{_tool('mkdir')} {spot} && {mount} --bind {shlex.quote(path)} {spot}")
        for m in mounts:
            _make_mount_point(m.target, bool(m.source) and Path(m.source).is_file())
            if m.source:
                steps.append(f"{mount} --bind {shlex.quote(m.source)} {shlex.quote(m.target)}")
                if m.read_only:
                    steps.append(f"{mount} -o remount,bind,ro {shlex.quote(m.target)}")
            else:
                steps.append(f"{mount} -t tmpfs -o mode=1777 tmp {shlex.quote(m.target)}")
        for i, path in enumerate(keep):
            spot, where = shlex.quote(f"{PARK}/{i}"), shlex.quote(path)
            steps.append(f"{_tool('mkdir')} -p {where} && {mount} --bind {spot} {where}")
            steps.append(f"{_tool('umount')} {spot}")
        if keep:
            steps.append(f"{_tool('umount')} {PARK}")
        steps.append(f"{_tool('hostname')} {shlex.quote(hostname or host)}")
        script = " && ".join(steps) + ' && exec "$@"'
        cmd = [_tool("ip"), "netns", "exec", h.netns, _tool("unshare"), "--uts", "--mount"]
        cmd += ["--propagation", "private", sh, "-c", script, "pod", *argv]
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
        out = _run(["ip", "netns", "pids", self.hosts[host].netns], check=False).stdout
        return [int(p) for p in out.split()]

    def close(self) -> None:
        """Ends every process on the lab's hosts and removes the namespaces and files."""
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        kill_process_groups(self.procs)
        names = [h.netns for h in self.hosts.values()] + [self.hub]
        _remove(names)
        release_state(os.getpid())


def enter_netns(netns: str) -> None:
    """Moves the calling thread (only it) into network namespace `netns`."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_DIR / netns, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({netns}): {os.strerror(err)}")
    finally:
        os.close(fd)


def kill_process_groups(procs: Sequence[subprocess.Popen[bytes]], grace_s: float = 5.0) -> None:
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


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def sweep() -> list[str]:
    """Removes namespaces and state left by labs whose process is gone; returns them."""
    listed = _run(["ip", "netns", "list"], check=False).stdout.split("\n")
    stale = []
    for line in listed:
        name = line.split(" ")[0]
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX) :].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            stale.append(name)
    _remove(stale)
    if STATE_DIR.is_dir():
        for entry in STATE_DIR.iterdir():
            if entry.is_dir() and entry.name.isdigit() and not _alive(int(entry.name)):
                release_state(int(entry.name))
    return stale


def release_state(pid: int) -> None:
    """Forgets lab `pid`; the last lab out removes the mount points labs created."""
    with contextlib.suppress(FileNotFoundError):
        (STATE_DIR / str(pid)).rmdir()
    alive = (
        [p for p in STATE_DIR.glob("[0-9]*") if _alive(int(p.name))] if STATE_DIR.exists() else []
    )
    made = STATE_DIR / "mount-points"
    if alive or not made.exists():
        return
    for line in sorted(made.read_text().splitlines(), key=len, reverse=True):
        path = Path(line)
        with contextlib.suppress(OSError):
            path.unlink() if path.is_file() else path.rmdir()
    made.unlink()
    with contextlib.suppress(OSError):
        STATE_DIR.rmdir()


def _make_mount_point(target: str, is_file: bool) -> None:
    """Creates `target` (and records it) when it does not exist on this machine."""
    path = Path(target)
    if path.exists():
        return
    missing = [p for p in [path, *path.parents] if not p.exists()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.touch() if is_file else path.mkdir()
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / "mount-points", "a") as f:
        f.writelines(f"{p}\n" for p in missing)


def _remove(netns_names: list[str]) -> None:
    for name in netns_names:
        for pid in _run(["ip", "netns", "pids", name], check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)  # ours: it runs in our namespace
        _run(["ip", "netns", "del", name], check=False)
        shutil.rmtree(ETC_NETNS / name, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _hidden_by(mounts: Sequence[Mount]) -> list[str]:
    """The folders this Python and hetero_pd run from that one of `mounts` would cover."""
    import hetero_pd

    needed = {Path(sys.prefix), Path(hetero_pd.__file__).resolve().parents[1]}
    needed = {p for p in needed if not any(q in p.parents for q in needed)}
    covered = [Path(m.target) for m in mounts]
    return sorted(str(p) for p in needed if any(t == p or t in p.parents for t in covered))


def _tool(name: str) -> str:
    """The absolute path of a system tool ("" if missing): a process's env may lack sbin."""
    return shutil.which(name, path=f"{os.environ.get('PATH', '')}:{SYSTEM_PATH}") or ""


def _ns(netns: str, *cmd: str) -> None:
    _run(["ip", "netns", "exec", netns, _tool(cmd[0]) or cmd[0], *cmd[1:]])


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = [_tool(cmd[0]) or cmd[0], *cmd[1:]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip() or proc.returncode}")
    return proc

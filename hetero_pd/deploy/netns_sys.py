"""The machine's side of network-namespace labs (`hetero_pd.deploy.netns`): the system tools
they run, the files and state they leave until removed, and how a process enters a host.

A host's process sees what `ip netns exec` gives (the host's network namespace, a mount
namespace of its own with a fresh /sys and `/etc/netns/<ns>/*` bound over `/etc`), plus new
UTS and mount namespaces for its hostname and mounts: exec'd, `ip netns exec ... unshare
--uts --mount` sets that up (`Lab.spawn`); a process forked from a lab's fork server enters
the same state itself (`enter_host`, `netns_exec_steps`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shlex
import shutil
import signal
import subprocess
from pathlib import Path

PREFIX = "hpd-"
NETNS_DIR = Path("/var/run/netns")
ETC_NETNS = Path("/etc/netns")
#: Labs alive now (one folder per pid) and the mount points they had to create.
STATE_DIR = Path("/run/hetero-pd-netns")
PARK = STATE_DIR / "park"  # where a process's software waits while a mount covers it
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWNET = 0x00020000, 0x04000000, 0x40000000
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


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


def enter_host(netns: str, script: str) -> None:
    """Moves this single-threaded process into network namespace `netns` and into new mount
    and UTS namespaces, then runs `script` (`netns_exec_steps` and the spawn's own steps)
    there: its mounts and hostname are then this process's."""
    enter_netns(netns)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS | CLONE_NEWUTS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(mount, uts): {os.strerror(err)}")
    done = subprocess.run([tool("sh"), "-c", script], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise RuntimeError(f"setting up host {netns} failed: {done.stderr.strip()}")


def netns_exec_steps(netns: str) -> list[str]:
    """What `ip netns exec NETNS` and `unshare --propagation private` do to a new mount
    namespace, as shell steps: no mount propagates back, a /sys of the namespace, and each
    of `/etc/netns/NETNS/*` bound over its `/etc` namesake."""
    mount, q = tool("mount"), shlex.quote
    steps = [f"{mount} --make-rprivate /", f"{tool('umount')} -l /sys"]
    steps.append(f"{mount} -t sysfs {q(netns)} /sys")
    folder = ETC_NETNS / netns
    for entry in sorted(folder.iterdir()) if folder.is_dir() else []:
        if (Path("/etc") / entry.name).exists():
            steps.append(f"{mount} --bind {q(str(entry))} {q(f'/etc/{entry.name}')}")
    return steps


def release_state(pid: int) -> None:
    """Forgets lab `pid`; the last lab out removes the mount points labs created."""
    with contextlib.suppress(FileNotFoundError):
        (STATE_DIR / str(pid)).rmdir()
    alive = (
        [p for p in STATE_DIR.glob("[0-9]*") if is_alive(int(p.name))] if STATE_DIR.exists() else []
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


def make_mount_point(target: str, is_file: bool) -> None:
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


def remove(netns_names: list[str]) -> None:
    """Kills every process in the namespaces `netns_names` and removes them and their files."""
    for name in netns_names:
        for pid in run(["ip", "netns", "pids", name], check=False).stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)  # ours: it runs in our namespace
        run(["ip", "netns", "del", name], check=False)
        shutil.rmtree(ETC_NETNS / name, ignore_errors=True)


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def tool(name: str) -> str:
    """The absolute path of a system tool ("" if missing): a process's env may lack sbin."""
    return shutil.which(name, path=f"{os.environ.get('PATH', '')}:{SYSTEM_PATH}") or ""


def ns(netns: str, *cmd: str) -> None:
    """Runs `cmd` in network namespace `netns` (raises naming it when it fails)."""
    run(["ip", "netns", "exec", netns, tool(cmd[0]) or cmd[0], *cmd[1:]])


def run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    cmd = [tool(cmd[0]) or cmd[0], *cmd[1:]]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip() or proc.returncode}")
    return proc

"""The lab itself: hosts reach each other only by their addresses and names, share no
memory or hostname, and leave nothing behind, also when the process that made them dies."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hetero_pd.deploy import netns
from hetero_pd.deploy.netns import Lab, Mount

pytestmark = [pytest.mark.usefixtures("netns_ok"), pytest.mark.timeout(120)]
PY = sys.executable
REPO = str(Path(__file__).resolve().parents[2])
ENV = {"PATH": "/usr/bin:/bin", "PYTHONPATH": REPO}
#: What a forked process runs (tests/multihost/program.py): `python -c`'s work.
PROGRAM = "tests.multihost.program:main"


def _serve_once(port: int, ready: list[bool]) -> bytes:
    with socket.create_server(("0.0.0.0", port)) as server:
        server.settimeout(20)
        ready.append(True)
        conn, _ = server.accept()
        with conn:
            return conn.recv(64)


def _send(address: str, port: int, data: bytes) -> None:
    deadline = time.monotonic() + 20
    while True:
        try:
            with socket.create_connection((address, port), timeout=5) as c:
                c.sendall(data)
                return
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _spawn(lab: Lab, host: str, argv: list[str], fork: bool, **kw: Any) -> netns.Proc:
    """`argv` (`python -c CODE ...`) on `host`: exec'd, or forked from the lab's fork server
    running `program.py` (the same code, as a forked pod runs its command's entry point)."""
    if not fork:
        return lab.spawn(host, argv, ENV, **kw)
    module = PROGRAM.split(":")[0]
    return lab.spawn(host, argv, ENV, entry=PROGRAM, preload=[module], **kw)


def _output(
    lab: Lab, host: str, code: str, mounts: list[Mount] | None = None, fork: bool = False
) -> str:
    """What a Python snippet prints when run as a process on `host` (exec'd or forked)."""
    log = Path(f"/tmp/hpd-test-{os.getpid()}-{host}.log")
    with open(log, "wb") as f:
        proc = _spawn(lab, host, [PY, "-c", code], fork, mounts=mounts or [], log=f)
        assert proc.wait(30) == 0, log.read_text()
    text = log.read_text()
    log.unlink()
    return text.strip()


def test_hosts_talk_over_the_bridge_by_address_and_name() -> None:
    with Lab() as lab:
        for name in ("router", "prefill-0", "prefill-1", "decode-0"):
            lab.add_host(name)
        lab.dns["decode-0.pods.test"] = lab.hosts["decode-0"].address
        lab.write_hosts()
        assert len({h.address for h in lab.hosts.values()}) == 4
        # One process per host: its own hostname, its own /dev/shm, the lab's DNS names.
        # ... and only its own network devices (its namespace's /sys).
        code = (
            "import os, socket; open('/dev/shm/mark', 'w').write('x');"
            "print(socket.gethostname(), sorted(os.listdir('/dev/shm')),"
            " socket.gethostbyname('decode-0.pods.test'), sorted(os.listdir('/sys/class/net')))"
        )
        # prefill-1's process is forked from the lab's fork server, prefill-0's exec'd: the
        # same host for both.
        seen = {h: _output(lab, h, code, fork=h == "prefill-1") for h in ("prefill-0", "prefill-1")}
        decode = lab.hosts["decode-0"].address
        assert seen["prefill-0"] == f"prefill-0 ['mark'] {decode} ['eth0', 'lo']"
        assert seen["prefill-1"] == f"prefill-1 ['mark'] {decode} ['eth0', 'lo']"
        assert not Path("/dev/shm/mark").exists()  # never this machine's /dev/shm
        assert socket.gethostname() not in seen["prefill-0"]
        # TCP from one host to another, by its address; its loopback is its own.
        ready: list[bool] = []
        port = 18123
        got: list[bytes] = []
        import threading

        server = threading.Thread(
            target=lambda: got.append(lab.call_in("decode-0", _serve_once, port, ready))
        )
        server.start()
        while not ready:
            time.sleep(0.01)
        lab.call_in("prefill-1", _send, decode, port, b"kv")
        server.join(30)
        assert got == [b"kv"]
        with pytest.raises(ConnectionRefusedError):
            lab.call_in("prefill-0", _send_now, "127.0.0.1", port)


def _send_now(address: str, port: int) -> None:
    with socket.create_connection((address, port), timeout=5):
        pass


@pytest.mark.parametrize("fork", [False, True], ids=["exec", "fork"])
def test_bind_mounts_are_private_to_the_process(tmp_path: Path, fork: bool) -> None:
    (tmp_path / "deployment.yaml").write_text("model: x\n")
    target = f"/tmp/hpd-mount-{os.getpid()}"
    with Lab() as lab:
        lab.add_host("a")
        mounts = [Mount(target, str(tmp_path), read_only=True), Mount(f"{target}-scratch")]
        code = (
            f"import os; print(open('{target}/deployment.yaml').read().strip());"
            f"open('{target}-scratch/x', 'w').write('y');"
            f"print(os.access('{target}/deployment.yaml', os.W_OK))"
        )
        assert _output(lab, "a", code, mounts, fork).split("\n") == ["model: x", "False"]
        assert not any(Path(target).iterdir())  # the machine's own folder stayed empty
    assert not Path(target).exists()  # created as a mount point, removed with the lab


@pytest.mark.parametrize("fork", [False, True], ids=["exec", "fork"])
def test_a_process_on_a_host_tells_its_exit_code(fork: bool) -> None:
    """Exec'd or forked, what `spawn` returns tells what a Popen does: None while it runs,
    then its exit code, or minus the signal that killed it."""
    with Lab() as lab:
        lab.add_host("a")
        done = _spawn(lab, "a", [PY, "-c", "import sys; sys.exit(3)"], fork)
        assert done.wait(30) == 3 and done.returncode == 3
        sleeper = _spawn(lab, "a", [PY, "-c", "import time; time.sleep(60)"], fork)
        assert sleeper.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            sleeper.wait(0.01)
        os.killpg(sleeper.pid, signal.SIGKILL)  # its own session
        assert sleeper.wait(30) == -signal.SIGKILL and sleeper.poll() == -signal.SIGKILL


def test_everything_is_removed_also_when_the_owner_is_killed(tmp_path: Path) -> None:
    code = (
        "from hetero_pd.deploy.netns import Lab; import time, sys;"
        "lab = Lab(); lab.add_host('a'); lab.add_host('b');"
        "lab.spawn('a', ['sleep', '600'], {'PATH': '/usr/bin:/bin'});"
        "print(lab.tag, flush=True); time.sleep(600)"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    owner = subprocess.Popen([PY, "-c", code], stdout=subprocess.PIPE, env=env, text=True)
    assert owner.stdout is not None
    tag = owner.stdout.readline().strip()
    assert tag == f"hpd-{owner.pid}"
    names = [f"{tag}-a", f"{tag}-b", f"{tag}-hub"]
    assert all(n in _netns_list() for n in names)
    sleeper = [int(p) for p in _run("ip", "netns", "pids", f"{tag}-a").split()]
    assert sleeper
    owner.send_signal(signal.SIGKILL)
    owner.wait(10)
    removed = netns.sweep()
    assert sorted(n for n in removed if n.startswith(tag)) == sorted(names)
    assert not any(n in _netns_list() for n in names)
    assert not Path(f"/etc/netns/{tag}-a").exists()
    deadline = time.monotonic() + 10
    while any(_exists(p) for p in sleeper) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(_exists(p) for p in sleeper)


def test_a_failure_inside_the_lab_still_removes_it() -> None:
    with pytest.raises(RuntimeError, match="boom"), Lab() as lab:
        lab.add_host("a")
        tag = lab.tag
        raise RuntimeError("boom")
    assert not [n for n in _netns_list() if n.startswith(f"{tag}-")]


# A pod that, on SIGTERM, leaves only once every pod of its lab has had its SIGTERM too (as
# a router draining its workers might): it exits 0 then, and dies by SIGKILL (-9) when the
# lab waits out its grace before signalling the next one.
POD_WAITING_FOR_ITS_PEERS = """
import os, pathlib, signal, sys, time
folder, me = pathlib.Path(sys.argv[1]), sys.argv[2]
def term(*_):
    (folder / (me + ".term")).touch()
    while len(list(folder.glob("*.term"))) < 2:
        time.sleep(0.01)
    os._exit(0)
signal.signal(signal.SIGTERM, term)
(folder / (me + ".ready")).touch()
while True:
    signal.pause()
"""


@pytest.mark.parametrize("fork", [False, True], ids=["exec", "fork"])
def test_closing_the_lab_signals_every_pod_before_waiting_for_any(
    tmp_path: Path, fork: bool
) -> None:
    """Stopping N pods takes one grace period, not N: each gets its SIGTERM at once."""
    with Lab() as lab:
        procs = []
        for name in ("a", "b"):
            lab.add_host(name)
            argv = [PY, "-c", POD_WAITING_FOR_ITS_PEERS, str(tmp_path), name]
            procs.append(_spawn(lab, name, argv, fork))
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.ready"))) < 2:
            assert all(p.poll() is None for p in procs), [p.returncode for p in procs]
            assert time.monotonic() < deadline, "the pods did not start"
            time.sleep(0.02)
    assert [p.returncode for p in procs] == [0, 0]  # both left on their SIGTERM


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def _netns_list() -> list[str]:
    return [line.split(" ")[0] for line in _run("ip", "netns", "list").splitlines()]


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=30).stdout

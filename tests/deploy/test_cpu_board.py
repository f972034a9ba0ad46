"""One host's unpinned workers get one CPU board, a slot each (hetero_pd/deploy/cpu_board.py);
pinned workers and a worker alone get none; the board's folder goes when they stop."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from backends.cpu_share import HostBoard
from hetero_pd.deploy.cpu_board import remove_cpu_board, sweep_stale_boards, with_cpu_board
from hetero_pd.deploy.launcher import worker_config
from hetero_pd.deploy.schema import parse_deployment
from hetero_pd.deploy.workers import expand_workers


def test_unpinned_workers_sharing_a_host_get_one_board() -> None:
    workers = [{"role": "both", "count": 2}, {"role": "decode", "cpus": [0]}]
    dep = parse_deployment({"model": "smollm2-135m-instruct", "workers": workers}, "<t>")
    instances = expand_workers(dep.workers)
    configs = [
        worker_config(dep, w, 1, None) if w.cpus else worker_config(dep, w, 4, 2) for w in instances
    ]
    shared, folder = with_cpu_board(configs)
    assert folder is not None and stat.S_IMODE(folder.stat().st_mode) == 0o700
    sharers = [c for c in shared if c.cpu_board]
    assert [c.cpu_board_slot for c in sharers] == [0, 1]  # the pinned one holds no slot
    assert {c.cpu_board for c in sharers} == {str(folder / "board")}
    HostBoard(sharers[1].cpu_board, sharers[1].cpu_board_slot).publish(True, 2)
    assert HostBoard(sharers[0].cpu_board, 0).others()[:2] == (True, 2)
    remove_cpu_board(folder)
    assert not folder.exists()
    alone, none = with_cpu_board([c for c in configs if not c.cpus][:1])
    assert none is None and not alone[0].cpu_board


def test_boards_a_killed_launcher_left_are_swept_and_no_others(tmp_path: Path) -> None:
    """A launcher killed outright cannot remove its board's folder; the next one to make a
    board removes ours whose launcher is gone, and nothing else: another uid's, a live one's, a
    stranger's name, a file, a link (not followed), or an old folder without a pid."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"hetero-pd-cpus-{dead.pid}-abc"
    live = tmp_path / f"hetero-pd-cpus-{os.getpid()}-def"
    old = tmp_path / "hetero-pd-cpus-xyz"
    other = tmp_path / f"not-hetero-pd-cpus-{dead.pid}-x"
    for d in (stale, live, old, other):
        d.mkdir(mode=0o700)
        (d / "board").write_bytes(b"\0" * 40)
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep").write_text("x")
    link = tmp_path / f"hetero-pd-cpus-{dead.pid}-link"
    link.symlink_to(target, target_is_directory=True)
    plain = tmp_path / f"hetero-pd-cpus-{dead.pid}-file"
    plain.write_text("x")

    stranger = tmp_path / f"hetero-pd-cpus-{dead.pid}-theirs"  # another uid's, same name
    stranger.mkdir(mode=0o700)
    if os.geteuid() == 0:  # root (as in CI) can hand it to nobody; others test the rest
        os.chown(stranger, 65534, 65534)

    swept = sweep_stale_boards(tmp_path)
    assert stale in swept and not stale.exists()
    assert all(p.exists() for p in (live, old, other, link, plain, target / "keep"))
    if os.geteuid() == 0:
        assert swept == [stale] and stranger.exists()


def test_a_board_folder_names_its_launcher() -> None:
    workers = [{"role": "both", "count": 2}]
    dep = parse_deployment({"model": "smollm2-135m-instruct", "workers": workers}, "<t>")
    configs = [worker_config(dep, w, 4, 2) for w in expand_workers(dep.workers)]
    _, folder = with_cpu_board(configs)
    try:
        assert folder is not None and folder.name.startswith(f"hetero-pd-cpus-{os.getpid()}-")
    finally:
        remove_cpu_board(folder)

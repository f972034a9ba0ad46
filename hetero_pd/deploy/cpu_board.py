"""The board through which one host's unpinned workers share its CPUs.

Workers the launcher starts unpinned on one host each start at their share of its CPUs and
may grow into a neighbour's while it idles (backends/cpu_share.py). So that a neighbour
that gets work has its CPU back at its next step, not after the grown worker's load
windows agree, they share a :class:`backends.cpu_share.HostBoard`: one small file, made
here in a folder of its own (mode 0700, removed when the workers stop), a slot per worker.
The folder's name carries the launcher's pid, so that the next launcher removes those of
launchers killed outright (`sweep_stale_boards`).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import tempfile
from dataclasses import replace
from pathlib import Path

from backends.cpu_share import HostBoard
from hetero_pd.deploy.netns_sys import is_alive
from hetero_pd.serving.worker.config import WorkerConfig

PREFIX = "hetero-pd-cpus-"
_NAME = re.compile(re.escape(PREFIX) + r"(\d{1,9})-[^/]+")  # a pid_t, at most
log = logging.getLogger("hetero_pd.deploy")


def shares_cpus(cfg: WorkerConfig) -> bool:
    """Unpinned and started below the threads it may grow to: a sharer of the host."""
    e = cfg.engine
    return (
        not cfg.cpus and e.initial_threads is not None and e.initial_threads < (e.num_threads or 0)
    )


def with_cpu_board(configs: list[WorkerConfig]) -> tuple[list[WorkerConfig], Path | None]:
    """``configs`` with a board for those that share the host's CPUs (two or more), and the
    folder to remove when they stop (None: no board was needed)."""
    sharers = [c.worker_id for c in configs if shares_cpus(c)]
    if len(sharers) < 2:
        return configs, None
    sweep_stale_boards(Path(tempfile.gettempdir()))
    folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))
    path = folder / "board"
    HostBoard.create(path, len(sharers))
    slot = {worker_id: i for i, worker_id in enumerate(sharers)}
    return [
        replace(c, cpu_board=str(path), cpu_board_slot=slot[c.worker_id])
        if c.worker_id in slot
        else c
        for c in configs
    ], folder


def remove_cpu_board(folder: Path | None) -> None:
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def sweep_stale_boards(tmp: Path) -> list[Path]:
    """Removes the board folders in `tmp` that are ours (this uid's, real folders, not
    links) and name a launcher pid no process has any more; returns them. Another uid's,
    a live launcher's and names without a pid (made before pids were named) stay."""
    swept = []
    for entry in tmp.glob(f"{PREFIX}*"):
        match = _NAME.fullmatch(entry.name)
        try:
            st = entry.lstat()
        except OSError:
            continue
        if match is None or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue
        if is_alive(int(match.group(1))):  # another uid's counts as alive
            continue
        shutil.rmtree(entry, ignore_errors=True)
        log.info("removed %s: its launcher (pid %s) is gone", entry, match.group(1))
        swept.append(entry)
    return swept

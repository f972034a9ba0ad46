"""An engine without a configured thread count uses the CPUs it is pinned to."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Pinned after torch has sized its thread pool, as a worker pins itself after its imports.
CHILD = """
import json, os, sys
import torch
from hetero_pd import LLM
before = torch.get_num_threads()
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
llm = LLM(sys.argv[1], num_kv_blocks=16)
threads = torch.get_num_threads()
print(json.dumps({"before": before, "threads": threads, "line": llm.engine.describe()}))
"""


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs sched_setaffinity")
def test_an_engine_pinned_to_one_cpu_runs_one_thread(tiny_llama_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "HETERO_PD_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(tiny_llama_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["threads"] == 1
    assert ", 1 threads, " in out["line"]


def test_an_engine_starts_at_its_initial_threads_and_may_grow_to_num_threads(
    tiny_llama_dir: Path,
) -> None:
    """A worker sharing the host starts at its share; the governor may add threads up to
    num_threads (it is given the maximum and the count in force)."""
    import torch

    from hetero_pd import LLM

    before = torch.get_num_threads()
    try:
        llm = LLM(str(tiny_llama_dir), num_kv_blocks=16, num_threads=3, initial_threads=1)
        assert torch.get_num_threads() == 1
        governor = llm.engine.thread_governor
        if governor is not None:  # off with HETERO_PD_ADAPTIVE_THREADS=0
            assert (governor.max_threads, governor.threads) == (3, 1)
        with pytest.raises(ValueError, match="initial_threads must be > 0"):
            LLM(str(tiny_llama_dir), num_kv_blocks=16, initial_threads=0)
    finally:
        torch.set_num_threads(before)


def test_an_engine_on_a_cpu_board_says_when_it_works_and_when_it_holds_no_cpu(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its slot says "working" while it steps requests and "idle" once a step finds nothing
    to run (every request done, or waiting for its KV), so a neighbour never waits on it."""
    import torch

    from backends.cpu_share import HostBoard
    from hetero_pd import LLM, SamplingParams

    monkeypatch.setenv("HETERO_PD_ADAPTIVE_THREADS", "1")
    HostBoard.create(tmp_path / "board", 2)
    neighbour = HostBoard(tmp_path / "board", 1)
    before = torch.get_num_threads()
    try:
        llm = LLM(str(tiny_llama_dir), num_kv_blocks=16, num_threads=2, initial_threads=1)
        llm.engine.share_cpus(HostBoard(tmp_path / "board", 0))
        llm.engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True), "r")
        llm.engine.step()
        assert neighbour.others()[:2] == (True, 1)
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        assert neighbour.others()[:2] == (True, 1)  # its last step ran: not idle yet
        assert llm.engine.step() == []
        assert neighbour.others()[:2] == (False, 0)
    finally:
        torch.set_num_threads(before)

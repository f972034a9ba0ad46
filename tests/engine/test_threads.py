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

"""How the project's `python -m` entry points end their process (hetero_pd/process_exit.py):
atexit handlers and `weakref.finalize` callbacks run and buffered output is written, as with
`sys.exit`; the interpreter's teardown after them (every module and object freed one by one:
~0.7 s of CPU for a worker of the tiny model, every time a worker stops) does not."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CHILD = """
import atexit, json, sys, weakref
from hetero_pd.process_exit import exit_after

class Noisy:
    def __del__(self, _open=open, path=sys.argv[1] + ".del"):  # held: teardown clears globals
        with _open(path, "w") as f:
            f.write("torn down")

class Held:
    pass

json.kept = Noisy()  # alive at exit in a module: the interpreter's teardown frees it
HELD = Held()
weakref.finalize(HELD, lambda: open(sys.argv[1] + ".finalize", "w").write("finalized"))
atexit.register(lambda: open(sys.argv[1] + ".atexit", "w").write("ran"))

def main():
    sys.stdout.write("buffered, never flushed by main")
    return 7

exit_after(main)
"""


def test_exit_runs_atexit_and_finalizers_and_skips_the_teardown(tmp_path: Path) -> None:
    stem = tmp_path / "child"
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(stem)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 7, out.stderr
    assert out.stdout == "buffered, never flushed by main"
    assert Path(f"{stem}.atexit").read_text() == "ran"
    assert Path(f"{stem}.finalize").read_text() == "finalized"
    assert not Path(f"{stem}.del").exists(), "the interpreter tore its objects down one by one"

"""`exit_after(main)`: how this project's `python -m` entry points end their process.

A process that imported torch and transformers holds hundreds of thousands of objects. After
`sys.exit` the interpreter tears them down one by one (module dicts cleared, objects freed,
the collector's last walks), which took a worker of the tiny model ~0.7 s after its last
atexit handler, and 1-2 s of CPU before `gc.freeze()`: time that every stopping deployment,
restarting worker and test stack waits for. So, once `main` returns, this runs the atexit
handlers (logging's flush, `weakref.finalize` callbacks, ours) as `sys.exit` would, flushes
stdout and stderr, and ends the process with `os._exit`: the OS reclaims the rest at once,
as multiprocessing's children end theirs. What is skipped is only `__del__` of objects still
alive at exit; nothing here leaves work to one (files are written in `with` blocks, sockets
and KV regions are closed by the code that opened them).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import sys
from collections.abc import Callable
from typing import NoReturn


def exit_after(main: Callable[[], int]) -> NoReturn:
    """`sys.exit(main())`, with the interpreter's teardown skipped (see the module doc)."""
    code = main()
    gc.freeze()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken pipe: nothing to write to
            stream.flush()
    os._exit(code if isinstance(code, int) else 1)

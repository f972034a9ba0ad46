"""A program for processes that `Lab.spawn(entry=...)` forks in the lab tests: given the
argv of `python -c CODE ARG...`, it runs CODE with sys.argv `["-c", ARG...]`, as that
exec'd command would."""

from __future__ import annotations

import sys


def main() -> int:
    at = sys.argv.index("-c")
    code, sys.argv = sys.argv[at + 1], ["-c", *sys.argv[at + 2 :]]
    exec(code, {"__name__": "__main__"})
    return 0

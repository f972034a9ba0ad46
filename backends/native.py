"""Building and loading hetero-pd's small C kernels (backends/csrc/*.c) on this machine.

A kernel is built on first use with the machine's C compiler (`-march=native`, so it uses
the vector units this CPU has; paths for other instruction sets are compiled in by target
attributes and called only where the CPU has them) into hetero-pd's cache, keyed by the
source, the compile command, the compiler's version and the CPU's flags (a library built
for one CPU is not loaded on another), in the folder the caller names (the engine's:
`kernels/` under HETERO_PD_CACHE_DIR). A cached library is loaded only when it and its
folder are ours and no one else's to write (nor any folder above it, as OpenSSH's
StrictModes checks), and the file loaded is the one checked: it is
opened, checked through its descriptor and loaded through that descriptor's /proc name, so
a file renamed into its place after the check is never the one run. No compiler, or a
failed build: `build` gives None and says so in the log, and the caller runs its portable
path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shlex
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from backends.cpuinfo import cpu_flags

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
#: Descriptors of the kernel files loaded through /proc/self/fd: kept open for the process's
#: life, because dlopen recognises a library it already loaded by its name, and a closed
#: descriptor's number (its name) would come back for another file.
_LOADED: list[int] = []


def compiler() -> list[str] | None:
    """$CC (it may hold arguments, e.g. "ccache gcc"), else the first of cc, gcc, clang."""
    cc = os.environ.get("CC")
    if cc:
        return shlex.split(cc)
    found = next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    return [found] if found else None


def command(cc: list[str], source: Path, out: str, flags: tuple[str, ...] = ()) -> list[str]:
    """The build command. OpenMP must be torch's own runtime (libgomp, already loaded by
    torch), so that torch's thread count and spin policy govern the kernel's threads too:
    gcc links it by default, clang must be told."""
    openmp = "-fopenmp=libgomp" if "clang" in version(tuple(cc)) else "-fopenmp"
    return [*cc, "-O3", "-march=native", *flags, openmp, "-fPIC", "-shared", str(source), "-o", out]


@functools.cache
def version(cc: tuple[str, ...]) -> str:
    try:
        done = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout


def _compile(cmd: Callable[[str], list[str]], out: Path) -> None:
    """Compiles into `out` (written beside it, then renamed: never half a file)."""
    out.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run(cmd(tmp), check=True, capture_output=True, text=True, timeout=300)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


class UntrustedKernel(Exception):
    """A cached kernel library another user could have written: it is not loaded."""


def check_private(path: Path) -> Path:
    """Loading a library runs its code: the file and its folder must be ours and writable
    by no one else (a shared HETERO_PD_CACHE_DIR, e.g. a volume other pods mount, must not
    let them plant one). Gives the name to load: the file checked, opened (not following
    a link) and named by its descriptor, so what is loaded is what was checked whatever
    ``path`` names by then (``path`` itself where there is no /proc)."""
    check_private_folder(path.parent)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        _check_owner(path, os.fstat(fd))
        opened = Path(f"/proc/self/fd/{fd}")
        if not opened.exists():
            os.close(fd)
            return path
    except BaseException:
        os.close(fd)
        raise
    _LOADED.append(fd)
    return opened


#: Folders that only this uid (and root) can reach, taken as they are in the walk above a
#: private folder (`trust_private_root`): a Kubernetes pod's /tmp, an emptyDir of mode 0777
#: without the sticky bit, that no other uid can see.
_PRIVATE_ROOTS: set[Path] = set()


def trust_private_root(path: Path) -> None:
    """Takes folder ``path`` as reachable by this uid and root alone (its caller knows: a
    pod's own emptyDir): the folders above a private folder are checked up to it, not it."""
    _PRIVATE_ROOTS.update((path.absolute(), path.resolve()))


def check_private_folder(path: Path) -> None:
    """`UntrustedKernel` unless the folder ``path`` is ours and no one else's to write (what
    is created in it is then ours alone to create), nor any folder above it (`_check_above`)."""
    _check_owner(path, path.stat())
    _check_above(path)


def _check_above(path: Path) -> None:
    """Every folder from ``path``'s parent up to /, the path as given and where it leads,
    as OpenSSH's StrictModes checks them: owned by root or us, and writable by no one else
    unless sticky and root's (/tmp). Whoever may write a folder above ours (or owns it, and
    may chmod it) can rename ours away and put theirs in its place, with their code in it."""
    me = os.getuid()
    given, real = path.absolute().parents, path.resolve().parents
    # Both ways down: a link on the way, where others may write, can be pointed elsewhere.
    for folder in dict.fromkeys([*given, *real]):
        if folder in _PRIVATE_ROOTS:
            continue
        st = folder.stat()
        shared = st.st_mode & 0o022 and not (st.st_mode & stat.S_ISVTX and st.st_uid == 0)
        if st.st_uid not in (0, me) or shared:
            raise UntrustedKernel(
                f"{folder}, above {path}, is owned by uid {st.st_uid} with mode "
                f"{st.st_mode & 0o7777:o}: whoever may write it can replace what is below; "
                f"only root or uid {me} may write each folder up to / (unless sticky and "
                "root's, as /tmp): choose another HETERO_PD_CACHE_DIR (or name a folder "
                "only this uid can reach, as a pod's own /tmp, in HETERO_PD_PRIVATE_DIR)"
            )


def _check_owner(path: Path, st: os.stat_result) -> None:
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise UntrustedKernel(
            f"{path} is owned by uid {st.st_uid} with mode {st.st_mode & 0o777:o}: only "
            f"uid {os.getuid()} may write it"
        )


def build(
    source: Path,
    kernel_dir: Path,
    what: str,
    load: Callable[[Path], ctypes.CDLL],
    flags: tuple[str, ...] = (),
) -> ctypes.CDLL | None:
    """`source` built into (or found in) `kernel_dir` and loaded by `load` (which sets its
    functions' types); None where it cannot be, with a warning naming `what` runs portable."""
    cc = compiler()
    if cc is None:
        log.warning("no C compiler (cc, gcc, clang or $CC): %s runs portable", what)
        return None
    key = hashlib.sha256(source.read_bytes())
    for header in sorted(CSRC.glob("*.h")):  # what the sources include
        key.update(header.read_bytes())
    cmd, flags_of_cpu = " ".join(command(cc, source, "OUT", flags)), " ".join(sorted(cpu_flags()))
    for part in (cmd, version(tuple(cc)), flags_of_cpu):
        key.update(part.encode())
    path = kernel_dir / f"{source.stem}-{key.hexdigest()[:16]}.so"
    try:
        if path.exists():
            checked = check_private(path)
            try:
                return load(checked)
            except (OSError, AttributeError):  # damaged: build it again
                path.unlink()
        _compile(lambda out: command(cc, source, out, flags), path)
        return load(check_private(path))  # built in a folder others could write?
    except UntrustedKernel as e:
        log.warning("%s: %s runs portable", e, what)
        return None
    except (OSError, AttributeError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or e
        log.warning(
            "building the %s kernel in %s failed (%s): %s runs portable (a writable "
            "HETERO_PD_CACHE_DIR and a working C compiler fix this)",
            what,
            path.parent,
            detail,
            what,
        )
        return None

"""Compiled code is run only from where no one else writes (issue 27, low): backends/native.py
loads the very file it checked (the check was stat-then-load, so a file swapped in between
was loaded unchecked), and inductor's cache folder is ours and private."""

from __future__ import annotations

import ctypes
import os
import subprocess
from pathlib import Path

import pytest

from backends import native
from backends.compiler import use_cache_dir
from hetero_pd.engine.model_runner import compiled_code_dir

needs_cc = pytest.mark.skipif(native.compiler() is None, reason="no C compiler")


def _source(folder: Path, value: int) -> Path:
    path = folder / f"which{value}.c"
    path.write_text(f"int which(void) {{ return {value}; }}\n")
    return path


@needs_cc
@pytest.mark.timeout(120)
def test_the_library_loaded_is_the_one_checked(tmp_path: Path) -> None:
    """Between the ownership check and the load, the kernel's name is given another library
    (as a process that can rename in a folder above could): the load still gets the file
    that was checked, never the one swapped in."""
    cc = native.compiler()
    assert cc is not None
    other = tmp_path / "other.so"
    subprocess.run(native.command(cc, _source(tmp_path, 2), str(other)), check=True)
    kernels = tmp_path / "kernels"
    loaded: list[str] = []

    def load(path: Path) -> ctypes.CDLL:
        (built,) = kernels.glob("which1-*.so")
        os.replace(other, built)  # the swap, right after the check
        loaded.append(str(path))
        lib = ctypes.CDLL(str(path))
        lib.which.restype = ctypes.c_int
        return lib

    lib = native.build(_source(tmp_path, 1), kernels, "test kernel", load)
    assert lib is not None and loaded
    assert lib.which() == 1, f"the swapped library was loaded from {loaded[0]}"


def test_inductor_code_is_kept_only_in_a_private_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inductor unpickles and runs what its cache holds: our folder for it is made private,
    and one others may write is refused (the engine then runs eager, as for a kernel), not
    handed to inductor (issue 27, low: the inductor cache had no check at all)."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    fresh = tmp_path / "fresh" / "inductor"
    use_cache_dir(fresh)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(fresh)
    assert fresh.stat().st_mode & 0o777 == 0o700
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    shared = tmp_path / "shared" / "inductor"
    shared.mkdir(parents=True)
    shared.chmod(0o777)
    with pytest.raises(native.UntrustedKernel, match="mode 777"):
        use_cache_dir(shared)
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") != str(shared)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("mode", "uid", "refused"),
    [
        (0o777, 0, True),  # world-writable, no sticky bit: anyone may rename our folder away
        (0o775, 0, True),  # group-writable
        (0o755, 12345, True),  # another user's: they may chmod it and then do the same
        (0o1777, 0, False),  # like /tmp: sticky and root's, so only we rename our entries
        (0o1777, 12345, True),  # sticky, but its owner may still rename anything in it
        (0o755, 0, False),
    ],
)
def test_a_private_folder_inside_a_folder_others_may_write_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int, uid: int, refused: bool
) -> None:
    """Our 0700 folder is only as private as the path to it: whoever may write a folder above
    (or owns it) can move ours away and put theirs, with their code, in its place. Every
    folder up to / is checked, as OpenSSH's StrictModes does (issue 27, third round)."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    parent = tmp_path / "parent"
    parent.mkdir()
    ours = parent / "cache" / "inductor"
    ours.mkdir(parents=True, mode=0o700)
    os.chown(parent, uid, -1)
    parent.chmod(mode)
    if refused:
        with pytest.raises(native.UntrustedKernel, match=f"{parent}.* uid {uid}"):
            use_cache_dir(ours)
        assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") != str(ours)
    else:
        use_cache_dir(ours)
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(ours)


@pytest.mark.timeout(60)
def test_a_link_to_a_private_folder_in_a_folder_others_may_write_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The folders above the path as given count too, not only above where it leads: a link
    to our private folder, kept where others may write, can be pointed at theirs."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    ours = tmp_path / "private" / "inductor"
    ours.mkdir(parents=True, mode=0o700)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    (shared / "cache").symlink_to(ours)
    with pytest.raises(native.UntrustedKernel, match=f"{shared}.* uid 0"):
        use_cache_dir(shared / "cache")


@pytest.mark.timeout(60)
def test_a_folder_named_private_is_taken_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Kubernetes pod's /tmp is an emptyDir of mode 0777 without the sticky bit that no
    other uid can reach: named private (HETERO_PD_PRIVATE_DIR, set by `render k8s`), it
    does not turn compiled code off below it; folders between it and ours are still checked."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(native, "_PRIVATE_ROOTS", set())
    pod_tmp = tmp_path / "tmp"
    ours = pod_tmp / "hetero-pd" / "inductor"
    ours.mkdir(parents=True, mode=0o700)
    pod_tmp.chmod(0o777)
    with pytest.raises(native.UntrustedKernel, match=str(pod_tmp)):
        use_cache_dir(ours)
    monkeypatch.setenv("HETERO_PD_PRIVATE_DIR", str(pod_tmp))
    monkeypatch.setenv("HETERO_PD_COMPILE_CACHE_DIR", str(pod_tmp / "hetero-pd"))
    assert compiled_code_dir("inductor") == ours
    use_cache_dir(ours)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(ours)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    (pod_tmp / "hetero-pd").chmod(0o777)  # below the private folder: checked as before
    with pytest.raises(native.UntrustedKernel, match=str(pod_tmp / "hetero-pd")):
        use_cache_dir(ours)

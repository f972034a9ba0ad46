"""How many threads a CPU engine may use: its affinity mask capped by its cgroup CPU quota
(v1 and v2, read from fake cgroup trees), never os.cpu_count()."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from backends import cpu, get_backend


@pytest.fixture
def cgroups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty fake /sys/fs/cgroup; tests write /proc/self/cgroup and the limit files."""
    root = tmp_path / "cgroup"
    root.mkdir()
    monkeypatch.setattr(cpu, "CGROUP_ROOT", root)
    monkeypatch.setattr(cpu, "PROC_SELF_CGROUP", tmp_path / "self-cgroup")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    return root


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_no_cgroup_information_means_the_affinity_mask(cgroups: Path) -> None:
    assert cpu.cgroup_cpu_quota() is None
    assert cpu.usable_cpus() == 8


def test_cgroup_v2_quota_caps_the_affinity_mask(cgroups: Path) -> None:
    write(cpu.PROC_SELF_CGROUP, "0::/kubepods/pod1/ctr\n")
    write(cgroups / "kubepods/pod1/ctr/cpu.max", "250000 100000\n")  # a 2.5-CPU limit
    assert cpu.cgroup_cpu_quota() == 2.5
    assert cpu.usable_cpus() == 2  # rounded down: a third thread would be throttled


def test_the_tightest_limit_on_the_path_to_the_root_wins(cgroups: Path) -> None:
    write(cpu.PROC_SELF_CGROUP, "0::/kubepods/pod1/ctr\n")
    write(cgroups / "kubepods/pod1/ctr/cpu.max", "max 100000\n")  # unlimited itself
    write(cgroups / "kubepods/pod1/cpu.max", "150000 100000\n")  # the pod's limit
    write(cgroups / "kubepods/cpu.max", "400000 100000\n")
    assert cpu.cgroup_cpu_quota() == 1.5
    assert cpu.usable_cpus() == 1


def test_inside_a_container_the_mount_root_is_its_own_group(cgroups: Path) -> None:
    write(cpu.PROC_SELF_CGROUP, "0::/\n")
    write(cgroups / "cpu.max", "300000 100000\n")
    assert cpu.usable_cpus() == 3


def test_hybrid_hosts_mount_v2_under_unified(cgroups: Path) -> None:
    write(cpu.PROC_SELF_CGROUP, "4:memory:/x\n1:cpu:/\n0::/job\n")
    write(cgroups / "unified/job/cpu.max", "200000 100000\n")
    assert cpu.usable_cpus() == 2


def test_cgroup_v1_quota_and_its_unlimited_sentinel(cgroups: Path) -> None:
    write(cpu.PROC_SELF_CGROUP, "5:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n")
    group = cgroups / "cpu,cpuacct/docker/abc"
    write(group / "cpu.cfs_quota_us", "-1\n")
    write(group / "cpu.cfs_period_us", "100000\n")
    assert cpu.cgroup_cpu_quota() is None
    write(group / "cpu.cfs_quota_us", "50000\n")  # half a CPU
    assert cpu.cgroup_cpu_quota() == 0.5
    assert cpu.usable_cpus() == 1  # never zero


def test_the_affinity_mask_caps_a_loose_quota(
    cgroups: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write(cpu.PROC_SELF_CGROUP, "0::/\n")
    write(cgroups / "cpu.max", "1600000 100000\n")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})  # pinned to one core
    assert cpu.usable_cpus() == 1


def test_garbage_in_cgroup_files_is_ignored(cgroups: Path) -> None:
    write(cpu.PROC_SELF_CGROUP, "nonsense\n0::/a\n")
    write(cgroups / "a/cpu.max", "lots 100000\n")
    assert cpu.cgroup_cpu_quota() is None
    assert cpu.usable_cpus() == 8


def test_the_cpu_backend_defaults_to_the_usable_cpus(cgroups: Path) -> None:
    write(cpu.PROC_SELF_CGROUP, "0::/\n")
    write(cgroups / "cpu.max", "200000 100000\n")
    assert get_backend("cpu").default_threads() == 2
    assert get_backend("cuda").default_threads() == 0  # accelerators keep torch's default


def test_this_process_is_counted_from_its_own_affinity() -> None:
    assert 1 <= cpu.usable_cpus() <= len(os.sched_getaffinity(0))


def test_compile_auto_on_cpu_only_without_the_kernel_and_with_a_cxx_compiler(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`compile: auto` runs eager on CPU where the decode kernel runs; without it, compiles
    only where inductor can build its C++."""
    backend = get_backend("cpu")
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(cpu.shutil, "which", lambda name: None)
    assert backend.compile_by_default(decode_kernel=False) is False
    monkeypatch.setattr(cpu.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert backend.compile_by_default(decode_kernel=False) is True
    assert backend.compile_by_default(decode_kernel=True) is False
    monkeypatch.setenv("CXX", "my-cxx")
    monkeypatch.setattr(cpu.shutil, "which", lambda name: None if name == "g++" else name)
    assert backend.compile_by_default(decode_kernel=False) is True  # $CXX: inductor's

"""``host_ram``: the machine's RAM bounded by the process's memory cgroup, read from a folder
laid out as ``/proc`` and ``/sys/fs/cgroup`` are under cgroup v2 and v1."""

from __future__ import annotations

import psutil
import pytest

from stagehand.common import host_ram as module
from stagehand.common.host_ram import host_ram

GIB = 2**30
MACHINE = (200 * GIB, 256 * GIB)  # (available, total)


@pytest.fixture(autouse=True)
def machine(monkeypatch):
    vm = psutil.virtual_memory()._replace(available=MACHINE[0], total=MACHINE[1])
    monkeypatch.setattr(module.psutil, "virtual_memory", lambda: vm)


def _write(root, path, text):
    file = root / path
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(text)


def test_cgroup_v2_limit_less_usage_without_inactive_page_cache(tmp_path):
    _write(tmp_path, "proc/self/cgroup", "0::/system.slice/trainer.service\n")
    folder = "sys/fs/cgroup/system.slice/trainer.service"
    _write(tmp_path, f"{folder}/memory.max", f"{64 * GIB}\n")
    _write(tmp_path, f"{folder}/memory.current", f"{30 * GIB}\n")
    _write(tmp_path, f"{folder}/memory.stat", f"anon {20 * GIB}\ninactive_file {6 * GIB}\n")
    _write(tmp_path, "sys/fs/cgroup/system.slice/memory.max", "max\n")
    assert host_ram(tmp_path) == (40 * GIB, 64 * GIB)
    # A tighter limit above the process's cgroup wins.
    _write(tmp_path, "sys/fs/cgroup/system.slice/memory.max", f"{48 * GIB}\n")
    _write(tmp_path, "sys/fs/cgroup/system.slice/memory.current", f"{40 * GIB}\n")
    assert host_ram(tmp_path) == (8 * GIB, 48 * GIB)


def test_cgroup_namespace_reads_the_mount_root(tmp_path):
    # Inside a container the process's path names a folder that is not mounted there.
    _write(tmp_path, "proc/self/cgroup", "0::/../../kubepods/pod1\n")
    _write(tmp_path, "sys/fs/cgroup/memory.max", f"{32 * GIB}")
    _write(tmp_path, "sys/fs/cgroup/memory.current", f"{2 * GIB}")
    assert host_ram(tmp_path) == (30 * GIB, 32 * GIB)


def test_cgroup_v1_limit_and_no_limit(tmp_path):
    _write(tmp_path, "proc/self/cgroup", "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n")
    folder = "sys/fs/cgroup/memory/docker/abc"
    _write(tmp_path, f"{folder}/memory.limit_in_bytes", f"{16 * GIB}\n")
    _write(tmp_path, f"{folder}/memory.usage_in_bytes", f"{5 * GIB}\n")
    _write(tmp_path, f"{folder}/memory.stat", f"cache {3 * GIB}\ntotal_inactive_file {GIB}\n")
    _write(tmp_path, "sys/fs/cgroup/memory/memory.limit_in_bytes", "9223372036854771712\n")
    assert host_ram(tmp_path) == (12 * GIB, 16 * GIB)
    _write(tmp_path, f"{folder}/memory.limit_in_bytes", "9223372036854771712\n")
    assert host_ram(tmp_path) == MACHINE


def test_no_cgroup_files_or_unreadable_ones_mean_the_machine(tmp_path):
    assert host_ram(tmp_path) == MACHINE  # no /proc/self/cgroup
    _write(tmp_path, "proc/self/cgroup", "0::/\n")
    _write(tmp_path, "sys/fs/cgroup/memory.max", "garbage")
    assert host_ram(tmp_path) == MACHINE
    # Usage above the limit (the kernel reclaiming) leaves nothing, not a negative figure.
    _write(tmp_path, "sys/fs/cgroup/memory.max", f"{GIB}")
    _write(tmp_path, "sys/fs/cgroup/memory.current", f"{2 * GIB}")
    assert host_ram(tmp_path) == (0, GIB)

"""Host RAM this process may still use: the machine's, bounded by its memory cgroup's limit.

``psutil.virtual_memory()`` reads ``/proc/meminfo``, which shows the whole machine even inside
a container started with a memory limit (``docker run --memory``, a Kubernetes limit, a
systemd slice). Memory taken beyond that limit is not refused: the kernel's OOM killer ends the
process, and a training run with it. So what the weight runtime's host cache may fill
(``runtime/stagehand/weights/host_cache.py``) is read here: the machine's available RAM, and where the
process's cgroup, or one above it, sets a limit, at most that limit less what the cgroup uses
(its page cache's inactive part left out, as the kernel reclaims it before it kills; the same
figure ``docker stats`` shows).

cgroup v2: ``/proc/self/cgroup``'s ``0::PATH`` line, ``/sys/fs/cgroup/PATH/memory.max`` ("max":
none), ``memory.current``, ``memory.stat``'s ``inactive_file``. cgroup v1: the ``memory``
controller's line, ``/sys/fs/cgroup/memory/PATH/memory.limit_in_bytes`` (a value near 2**63:
none), ``memory.usage_in_bytes``, ``memory.stat``'s ``total_inactive_file``. Inside a cgroup
namespace PATH is ``/`` and the container's own limit is at the mount's root. Unreadable or
absent files mean no limit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import psutil

UNLIMITED_V1 = 2**60
"""A cgroup v1 limit at or above this is "no limit" (the kernel writes 2**63 rounded to pages)."""


def host_ram(root: Path = Path("/")) -> tuple[int, int]:
    """``(available, total)`` bytes of host RAM for this process: ``psutil``'s figures, each at
    most the tightest memory cgroup limit above the process (``total``: the limit;
    ``available``: the limit less the cgroup's usage). ``root``: where ``/proc`` and ``/sys``
    are (tests point it at a folder of their own)."""
    vm = psutil.virtual_memory()
    available, total = int(vm.available), int(vm.total)
    for limit, used in _cgroup_limits(root):
        total = min(total, limit)
        available = min(available, max(0, limit - used))
    return available, total


PINNED_CAP_FRACTION = 0.5
"""Share of RAM a process may page-lock on Windows and WSL2 (the driver caps ``cudaHostAlloc``
and ``cudaHostRegister`` near half of RAM: musubi-tuner #685, AnimaLoraStudio PR #511, in
the peers survey; NVIDIA's CUDA on WSL guide lists pinned system memory as limited)."""


def pinned_cap(total: int, root: Path = Path("/")) -> int | None:
    """Bytes of host memory this process may page-lock when the platform caps it below RAM
    (Windows, WSL2: ``PINNED_CAP_FRACTION`` of ``total``), None where no cap is known (Linux:
    page-locked memory is bounded by RAM, which ``host_ram`` reads). ``root``: as in
    ``host_ram``."""
    if sys.platform == "win32":
        return int(PINNED_CAP_FRACTION * total)
    try:
        release = (root / "proc/sys/kernel/osrelease").read_text().lower()
    except OSError:
        return None
    return int(PINNED_CAP_FRACTION * total) if "microsoft" in release else None


def _cgroup_limits(root: Path) -> list[tuple[int, int]]:
    """``(limit, used)`` of every memory cgroup from the process's up to the hierarchy's root
    that sets a limit."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            out += _walk(root / "sys/fs/cgroup", path, _v2)
        elif "memory" in controllers.split(","):
            out += _walk(root / "sys/fs/cgroup/memory", path, _v1)
    return out


def _walk(mount: Path, path: str, read) -> list[tuple[int, int]]:
    # The process's own folder and each one above it; inside a cgroup namespace the path
    # names a folder that is not there, and the mount's root is the container's cgroup.
    folder = mount / path.strip("/")
    if not folder.is_dir():
        folder = mount
    found = []
    while True:
        figures = read(folder)
        if figures is not None:
            found.append(figures)
        if folder == mount or mount not in folder.parents:
            return found
        folder = folder.parent


def _v2(folder: Path) -> tuple[int, int] | None:
    limit = _number(folder / "memory.max")  # "max": no limit
    if limit is None:
        return None
    used = (_number(folder / "memory.current") or 0) - _stat(folder, "inactive_file")
    return limit, max(0, used)


def _v1(folder: Path) -> tuple[int, int] | None:
    limit = _number(folder / "memory.limit_in_bytes")
    if limit is None or limit >= UNLIMITED_V1:
        return None
    used = (_number(folder / "memory.usage_in_bytes") or 0) - _stat(folder, "total_inactive_file")
    return limit, max(0, used)


def _number(path: Path) -> int | None:
    """The file's integer, or None (absent, unreadable, or not a number such as "max")."""
    try:
        text = path.read_text().strip()
    except (OSError, ValueError):
        return None
    return int(text) if text.isdigit() else None


def _stat(folder: Path, key: str) -> int:
    try:
        text = (folder / "memory.stat").read_text()
    except (OSError, ValueError):
        return 0
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0

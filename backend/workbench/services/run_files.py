"""The files a run's folder holds for the user, read safely: samples, LoRA files, checkpoints.

Only regular files whose real path lies inside the run folder count. A folder that is a
symlink, a file that is a symlink, or a file with a second name (a hard link: the other name may
be ``/etc/passwd``) is left out, so nothing outside the run folder is listed or served, whatever
a worker or a user put there.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from workbench.api.errors import Conflict

CONFIG_FILE = "config.json"
"""The run's config in its folder: what the worker trains (``workbench train DIR/config.json``)."""


class RunFolderTaken(Conflict):
    """A new run's folder exists already: it belongs to another run (HTTP 409)."""


def write_run_config(run_dir: Path, config: dict[str, Any]) -> None:
    """Create ``run_dir`` and write ``config`` to its ``config.json`` atomically (a temporary
    file renamed into place). A queued run whose folder has no config yet is not launched
    (``Supervisor._launch_queued``): the row is stored before its folder is written, and a
    supervisor tick in between once failed a run with "could not start the worker: No such
    file or directory: .../worker.log".

    Raises:
        RunFolderTaken: ``run_dir`` exists (a new run never writes into another run's folder;
            ``Store.create_run`` gives no id of an existing folder, this is the last guard).
    """
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        run_dir.mkdir()
    except FileExistsError:
        raise RunFolderTaken(
            f"the run folder {run_dir} exists already: it holds another run's files, which a "
            "new run must not overwrite"
        ) from None
    tmp = run_dir / f".{CONFIG_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(config, indent=2))
    os.replace(tmp, run_dir / CONFIG_FILE)


def has_config(run_dir: Path) -> bool:
    """Whether ``write_run_config`` has written ``run_dir``'s config."""
    return (run_dir / CONFIG_FILE).is_file()


ARTIFACT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")

ARTIFACT_NAME_PATTERN = r"^[A-Za-z0-9](?:[A-Za-z0-9_-]|\.[A-Za-z0-9_-])*\.?$"
"""``ARTIFACT_RE`` without ``..`` in one pattern without look-around (the API's path schema:
pydantic's regex engine has none): a dot is never followed by another dot. With a length of at
most 200 it accepts exactly the names ``ARTIFACT_RE`` matches that hold no ``..``."""


def servable(path: Path, run_dir: Path) -> bool:
    """Whether ``path`` is a regular file with one name whose real path is inside ``run_dir``."""
    try:
        info = path.lstat()
        real = path.resolve(strict=True)
    except (OSError, RuntimeError):  # gone, or a symlink loop
        return False
    return stat.S_ISREG(info.st_mode) and info.st_nlink == 1 and real.is_relative_to(run_dir)


def artifact_files(run_dir: Path, folder: str = "samples") -> list[Path]:
    """The servable files of ``run_dir/folder``, by name."""
    where = run_dir / folder
    if where.is_symlink() or not where.is_dir():
        return []
    return sorted(p for p in where.iterdir() if ARTIFACT_RE.match(p.name) and servable(p, run_dir))


CHECKPOINT_RE = re.compile(r"^step-(\d{1,9})$")


def checkpoints(run_dir: Path) -> list[dict]:
    """The run's checkpoints, oldest first: ``[{name, step, size, modified}]`` (size: bytes of
    the servable files in ``checkpoints/step-N``)."""
    where = run_dir / "checkpoints"
    if where.is_symlink() or not where.is_dir():
        return []
    out = []
    for folder in where.iterdir():
        match = CHECKPOINT_RE.match(folder.name)
        if not match or folder.is_symlink() or not folder.is_dir():
            continue
        files = artifact_files(run_dir, f"checkpoints/{folder.name}")
        if not files:
            continue
        stats = [f.stat() for f in files]
        out.append(
            {
                "name": folder.name,
                "step": int(match.group(1)),
                "size": sum(st.st_size for st in stats),
                "modified": max(st.st_mtime for st in stats),
            }
        )
    return sorted(out, key=lambda c: c["step"])

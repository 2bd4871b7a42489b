"""Run artifacts: the sample images in ``DIR/samples/``, listed and served by plain name.

Only regular files whose real path lies inside the run folder are listed or served. A
``samples/`` that is a symlink, a file that is a symlink, or a file with a second name (a hard
link: the other name may be ``/etc/passwd``) is left out, so nothing outside the run folder
comes back, whatever a worker or a user put there.
"""

from __future__ import annotations

import mimetypes
import re
import stat
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter
from fastapi import Path as PathParam
from fastapi.responses import FileResponse

from backend.api.deps import SettingsDep, StoreDep, run_row
from backend.errors import Invalid, NotFound
from backend.models import RunId
from backend.openapi import errors

router = APIRouter(prefix="/api/runs", tags=["artifacts"])
ARTIFACT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")


def run_folder(settings, run_id: int) -> Path:
    """``runs_dir/<id>`` with the runs folder resolved and the run's own folder not."""
    return settings.runs_dir.resolve() / str(run_id)


def servable(path: Path, run_dir: Path) -> bool:
    """Whether ``path`` is a regular file with one name whose real path is inside ``run_dir``."""
    try:
        info = path.lstat()
        real = path.resolve(strict=True)
    except (OSError, RuntimeError):  # gone, or a symlink loop
        return False
    return stat.S_ISREG(info.st_mode) and info.st_nlink == 1 and real.is_relative_to(run_dir)


def artifact_files(run_dir: Path) -> list[Path]:
    """The servable files of ``run_dir/samples``, by name."""
    folder = run_dir / "samples"
    if folder.is_symlink() or not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if ARTIFACT_RE.match(p.name) and servable(p, run_dir))


@router.get("/{run_id}/artifacts", responses=errors(404))
def list_artifacts(run_id: RunId, store: StoreDep, settings: SettingsDep) -> dict:
    """Sample images of a run: ``{data: [{name, size, modified, url}], count}``."""
    run_row(store, run_id)
    data = []
    for p in artifact_files(run_folder(settings, run_id)):
        info = p.stat()
        url = f"/api/runs/{run_id}/artifacts/{p.name}"
        data.append({"name": p.name, "size": info.st_size, "modified": info.st_mtime, "url": url})
    return {"data": data, "count": len(data)}


@router.get("/{run_id}/artifacts/{name}", responses=errors(404))
def get_artifact(
    run_id: RunId,
    store: StoreDep,
    settings: SettingsDep,
    name: Annotated[str, PathParam(max_length=200)],
):
    """One file of the run's ``samples/`` folder, by name only (no paths, no dot-files)."""
    run_row(store, run_id)
    if not ARTIFACT_RE.match(name) or ".." in name:
        raise Invalid(f"artifact names are plain file names, got {name!r}", field="name")
    run_dir = run_folder(settings, run_id)
    path = run_dir / "samples" / name
    if not path.parent.is_symlink() and servable(path, run_dir):
        media = mimetypes.guess_type(name)[0] or "application/octet-stream"
        return FileResponse(path, media_type=media, headers={"cache-control": "max-age=60"})
    raise NotFound(f"run {run_id} has no artifact {name!r}", field="name")

"""Run artifacts: the sample images in ``DIR/samples/`` and the LoRA files in ``DIR/lora/``,
listed and served by plain name; the checkpoints in ``DIR/checkpoints/step-N/`` listed (a run
stopped before its end resumes from the last one: ``POST /api/runs/{id}/resume``). What is
servable: ``workbench.services.run_files``.
"""

from __future__ import annotations

import mimetypes
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter
from fastapi import Path as PathParam
from fastapi.responses import FileResponse

from workbench.api.deps import SettingsDep, StoreDep, run_row
from workbench.api.errors import Invalid, NotFound
from workbench.api.models import RunId
from workbench.api.openapi import errors
from workbench.contract.status import RESUMABLE
from workbench.services.run_files import (
    ARTIFACT_NAME_PATTERN,
    ARTIFACT_RE,
    artifact_files,
    checkpoints,
    servable,
)

ArtifactName = Annotated[str, PathParam(max_length=200, pattern=ARTIFACT_NAME_PATTERN)]
"""A plain file name: a letter or digit, then letters, digits, ``._-``, never ``..``."""

router = APIRouter(prefix="/api/runs", tags=["artifacts"])


def run_folder(settings, run_id: int) -> Path:
    """``runs_dir/<id>`` with the runs folder resolved and the run's own folder not."""
    return settings.runs_dir.resolve() / str(run_id)


def _listing(run_id: int, files: list[Path], route: str) -> list[dict]:
    out = []
    for p in files:
        info = p.stat()
        url = f"/api/runs/{run_id}/{route}/{p.name}"
        out.append({"name": p.name, "size": info.st_size, "modified": info.st_mtime, "url": url})
    return out


def _serve(run_dir: Path, folder: str, run_id: int, name: str) -> FileResponse:
    if not ARTIFACT_RE.match(name) or ".." in name:
        raise Invalid(f"artifact names are plain file names, got {name!r}", field="name")
    path = run_dir / folder / name
    if not path.parent.is_symlink() and servable(path, run_dir):
        media = mimetypes.guess_type(name)[0] or "application/octet-stream"
        return FileResponse(path, media_type=media, headers={"cache-control": "max-age=60"})
    raise NotFound(f"run {run_id} has no {folder} file {name!r}", field="name")


@router.get("/{run_id}/artifacts", responses=errors(404))
def list_artifacts(run_id: RunId, store: StoreDep, settings: SettingsDep) -> dict:
    """Sample images of a run: ``{data: [{name, size, modified, url}], count}``."""
    run_row(store, run_id)
    data = _listing(run_id, artifact_files(run_folder(settings, run_id)), "artifacts")
    return {"data": data, "count": len(data)}


@router.get("/{run_id}/outputs", responses=errors(404))
def list_outputs(run_id: RunId, store: StoreDep, settings: SettingsDep) -> dict:
    """What a run wrote for the user: ``{lora: [{name, size, modified, url}], checkpoints:
    [{name, step, size, modified}], resumable}``; ``resumable``: the run stopped before its end
    (failed, cancelled, killed, crashed) and has a checkpoint to continue from."""
    run = run_row(store, run_id)
    run_dir = run_folder(settings, run_id)
    saved = checkpoints(run_dir)
    return {
        "lora": _listing(run_id, artifact_files(run_dir, "lora"), "lora"),
        "checkpoints": saved,
        "resumable": bool(saved) and run["status"] in RESUMABLE,
    }


@router.get("/{run_id}/lora/{name}", responses=errors(404))
def get_lora(
    run_id: RunId,
    store: StoreDep,
    settings: SettingsDep,
    name: ArtifactName,
):
    """One file of the run's ``lora/`` folder (the LoRA weights, its ComfyUI-layout copy), as a
    download named after the run."""
    run_row(store, run_id)
    response = _serve(run_folder(settings, run_id), "lora", run_id, name)
    response.headers["content-disposition"] = f'attachment; filename="run-{run_id}-{name}"'
    return response


@router.get("/{run_id}/artifacts/{name}", responses=errors(404))
def get_artifact(
    run_id: RunId,
    store: StoreDep,
    settings: SettingsDep,
    name: ArtifactName,
):
    """One file of the run's ``samples/`` folder, by name only (no paths, no dot-files)."""
    run_row(store, run_id)
    return _serve(run_folder(settings, run_id), "samples", run_id, name)

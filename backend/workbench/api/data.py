"""``POST /api/data/scan``: the dataset scan a run would start with, for the New run page to
show before Start (``backend/workbench/worker/scan.py``: the worker runs the same scan and records it). The scan
runs in one of the server's folder-read slots, under its time limit
(``workbench.services.folder_reads``)."""

from __future__ import annotations

import os
from pathlib import Path

from fastapi import APIRouter

from workbench.api.deps import StoreDep
from workbench.api.errors import Invalid
from workbench.api.models import DatasetScan, ScanRequest
from workbench.api.openapi import errors
from workbench.services.folder_reads import READS, RESPONSES
from workbench.services.presets import run_config
from workbench.services.torch_side import import_torch_side
from workbench.worker.preset import validate_preset
from workbench.worker.scan import DataError, scan_folder

router = APIRouter(prefix="/api/data", tags=["data"])


@router.post("/scan", response_model=DatasetScan, responses={**errors(404), **RESPONSES})
def scan(body: ScanRequest, store: StoreDep) -> dict:
    """Usable samples, every file left out with its reason, caption warnings, and ``problem``
    when a run would fail on this data. A factory's data set (``data.factory``) is built by the
    worker: ``usable`` is null then.

    Raises:
        Invalid (422): ``data.path`` is not a folder or a name the file system refuses, or
            ``model.path`` holds a malformed ``model_index.json`` (names the file and key).
        Busy (503): every folder-read slot is taken.
        ReadTimeout (504): the folders did not answer within the time limit.
    """
    preset = validate_preset(run_config(store, body.preset, body.overrides))
    data = preset.data
    if data.factory is not None:
        note = f"data.factory {data.factory!r}: built and scanned by the worker when the run starts"
        return {"folder": None, "usable": None, "on_bad_file": data.on_bad_file, "note": note}
    prefix = "overrides" if body.overrides else "preset"
    if preset.model.path is not None:
        # Before the time limit starts: the first import takes seconds (torch, diffusers).
        import_torch_side()

    def read():
        videos = takes_clips(preset.model.path, field=f"{prefix}.model.path")
        return scan_folder(
            Path(data.path).expanduser(),
            captions=data.captions,
            default_caption=data.default_caption,
            limit=data.limit,
            frames=None if videos else data.frames,  # a video family's: frames per clip
            on_bad_file=data.on_bad_file,
            videos=videos,
        )

    try:
        found = READS.run(read, path=data.path, field=f"{prefix}.data.path")
    except DataError as exc:  # the folder went away since it was checked
        raise Invalid(str(exc), field=f"{prefix}.data.path") from None
    except OSError as exc:  # a name the file system refuses (ENAMETOOLONG, EACCES, ELOOP...)
        name = str(exc.filename or data.path)
        shown = repr(name[:80]) + ("..." if len(name) > 80 else "")
        message = f"data.path: cannot read {shown} ({exc.strerror or exc})"
        raise Invalid(message, field=f"{prefix}.data.path") from None
    return found.record()


def takes_clips(model_path: str | None, field: str = "model.path") -> bool:
    """Whether ``model.path`` is a video pipeline folder (Wan, LTX-2), whose runs take video
    clips beside the images (the worker's scan does the same). Not a pipeline folder (no
    ``model_index.json``): False, the run says why when it starts.

    Raises:
        Invalid (422): ``model_index.json`` is there but malformed (not a regular file, not
            JSON, too deep, a ``_class_name`` that is not a known pipeline class), naming
            ``field``, the file and the key.
    """
    if model_path is None:
        return False
    from workbench.worker.pipelines import (  # lazy: the server starts without torch
        ADAPTERS,
        PipelineFolderError,
    )
    from workbench.worker.pipelines.folder import (  # lazy: the server starts without torch
        detect_family,
    )

    try:
        family, _ = detect_family(model_path)
    except PipelineFolderError as exc:
        if not os.path.lexists(Path(model_path).expanduser() / "model_index.json"):
            return False  # not a pipeline folder: the run says why when it starts
        raise Invalid(str(exc), field=field) from None
    return family in ADAPTERS and ADAPTERS[family].video

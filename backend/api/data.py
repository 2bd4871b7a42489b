"""``POST /api/data/scan``: the dataset scan a run would start with, for the New run page to
show before Start (``worker/scan.py``: the worker runs the same scan and records it)."""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter

from backend.api.deps import StoreDep
from backend.api.errors import Invalid
from backend.api.models import DatasetScan, ScanRequest
from backend.api.openapi import errors
from backend.services.presets import run_config
from worker.preset import validate_preset
from worker.scan import DataError, scan_folder

router = APIRouter(prefix="/api/data", tags=["data"])


@router.post("/scan", response_model=DatasetScan, responses=errors(404))
def scan(body: ScanRequest, store: StoreDep) -> dict:
    """Usable samples, every file left out with its reason, caption warnings, and ``problem``
    when a run would fail on this data. A factory's data set (``data.factory``) is built by the
    worker: ``usable`` is null then."""
    preset = validate_preset(run_config(store, body.preset, body.overrides))
    data = preset.data
    if data.factory is not None:
        note = f"data.factory {data.factory!r}: built and scanned by the worker when the run starts"
        return {"folder": None, "usable": None, "on_bad_file": data.on_bad_file, "note": note}
    videos = takes_clips(preset.model.path)
    try:
        found = scan_folder(
            Path(data.path).expanduser(),
            captions=data.captions,
            default_caption=data.default_caption,
            limit=data.limit,
            frames=None if videos else data.frames,  # a video family's: frames per clip
            on_bad_file=data.on_bad_file,
            videos=videos,
        )
    except DataError as exc:  # the folder went away since it was checked
        prefix = "overrides" if body.overrides else "preset"
        raise Invalid(str(exc), field=f"{prefix}.data.path") from None
    return found.record()


def takes_clips(model_path: str | None) -> bool:
    """Whether ``model.path`` is a video pipeline folder (Wan, LTX-2), whose runs take video
    clips beside the images (the worker's scan does the same)."""
    if model_path is None:
        return False
    from worker.pipelines import (  # lazy: the server starts without torch
        ADAPTERS,
        PipelineFolderError,
    )
    from worker.pipelines.folder import detect_family  # lazy: the server starts without torch

    try:
        family, _ = detect_family(model_path)
    except PipelineFolderError:  # not a pipeline folder: the run says why when it starts
        return False
    return family in ADAPTERS and ADAPTERS[family].video

"""``GET /api/system``: device, VRAM and RAM totals, torch and CUDA versions;
``GET /api/limits/fields``: the live-limit fields' config paths and watermark pairs;
``GET /api/overrides/folders``: the preset fields a run's own folder drops."""

from __future__ import annotations

from fastapi import APIRouter

from backend.api.deps import ProbeDep
from backend.api.models import FolderFields, LimitFields, SystemInfo
from backend.services.limits import limit_fields
from contract.preset.overrides import bound_fields

router = APIRouter(prefix="/api", tags=["system"])


@router.get("/system", response_model=SystemInfo)
def system_info(probe: ProbeDep) -> dict:
    return probe.info()


@router.get("/limits/fields", response_model=LimitFields)
def live_limit_fields() -> dict:
    """Every live-limit field's config path and the (high, low) watermark pairs, so that the
    dashboard binds its inputs without a table of its own."""
    return limit_fields()


@router.get("/overrides/folders", response_model=FolderFields)
def folder_fields() -> dict:
    """The preset fields a run that names its own folder (``model.path``, ``data.path``) drops
    where the preset names none, as ``POST /api/runs`` does: the New run page drops the same
    from the config it shows, from this list rather than a table of its own."""
    return {"bound": {folder: list(paths) for folder, paths in bound_fields().items()}}

"""``GET /api/system``: device, VRAM and RAM totals, torch and CUDA versions;
``GET /api/limits/fields``: the live-limit fields' config paths and watermark pairs;
``GET /api/overrides/folders``: the preset fields a run's own folder drops;
``GET /api/system/disk``: whether writes to the data dir fail for a full disk."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field

from workbench.api.deps import ProbeDep, SettingsDep
from workbench.api.models import FolderFields, LimitFields, SystemInfo
from workbench.contract.preset.overrides import bound_fields
from workbench.services.diskfull import condition
from workbench.services.limits import limit_fields

router = APIRouter(prefix="/api", tags=["system"])


@router.get("/system", response_model=SystemInfo)
def system_info(probe: ProbeDep) -> dict:
    return probe.info()


class DiskStatus(BaseModel):
    """The data dir's disk as the server's writes found it (``workbench.services.diskfull``)."""

    full: bool = Field(description="writes under the data dir fail for a full disk")
    path: str = Field(description="the data dir")
    free_bytes: int | None = Field(description="bytes free there now; null when unreadable")
    since: float | None = Field(description="seconds since the epoch of the first failed write")
    failures: int = Field(description="writes failed since then")
    message: str | None = Field(description='"disk full at PATH: N bytes free" while full')


@router.get("/system/disk", response_model=DiskStatus)
def disk_status(settings: SettingsDep) -> dict:
    """Whether writes fail for a full disk; the dashboard shows "disk full at PATH" while they
    do. Clears when a write succeeds again or 1 MiB was freed there."""
    return condition(settings.data_dir).status()


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

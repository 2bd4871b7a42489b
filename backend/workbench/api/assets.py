"""The demo assets: ``GET /api/assets`` (the build's stages and progress, which presets wait for
it) and ``POST /api/assets/build`` (start, retry after a failed stage, resume after an
interruption; stages already built are kept)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, status
from pydantic import BaseModel, Field

from workbench.api.deps import AssetsDep, StoreDep
from workbench.api.errors import Conflict
from workbench.api.openapi import errors
from workbench.worker.asset_status import current

router = APIRouter(prefix="/api/assets", tags=["assets"])


class AssetStage(BaseModel):
    name: str = Field(description="digits, demo VAE, demo base, demo samples, factory models")
    state: str = Field(description="pending, running, done, failed or interrupted")
    done: int
    total: int
    unit: str = Field(description="what done/total count: images, steps, models")
    elapsed_s: float = Field(description="seconds this stage has run (this build)")
    estimate_s: float | None = Field(description="seconds left in this stage (estimate)")
    kept: bool = Field(description="already built before this build: not rebuilt")
    error: str | None = Field(description="the exception type and message of a failed stage")


class AssetsPublic(BaseModel):
    state: str = Field(description="missing, building, ready, failed or interrupted")
    running: bool = Field(description="a build process is running")
    stages: list[AssetStage]
    failed_stage: str | None = None
    error: str | None = None
    traceback: str | None = Field(None, description="the end of a failed stage's traceback")
    started_at: float | None = Field(None, description="unix seconds")
    finished_at: float | None = Field(None, description="unix seconds")
    estimate_s: float | None = Field(description="seconds left in the whole build (estimate)")
    cache_dir: str
    blocked_presets: dict[str, str] = Field(
        description="preset name -> why a run of it cannot start yet (the assets it waits for)"
    )
    retry_command: str = "workbench demo-assets"


def _public(assets, store) -> dict[str, Any]:
    # The status file read once: settled for the answer, as it is for every preset's refusal
    # (a build this server just started, not holding the lock yet, changes no refusal).
    on_disk = current(assets.cache)
    body = assets.status(on_disk)
    blocked = {}
    for preset in store.list_presets():
        why = assets.refusal(preset["config"], on_disk)
        if why is not None:
            blocked[preset["name"]] = why
    return {**body, "blocked_presets": blocked}


@router.get("", response_model=AssetsPublic)
def get_assets(assets: AssetsDep, store: StoreDep) -> dict:
    return _public(assets, store)


@router.post(
    "/build",
    response_model=AssetsPublic,
    status_code=status.HTTP_202_ACCEPTED,
    responses=errors(409),
)
def build_assets(assets: AssetsDep, store: StoreDep) -> dict:
    """Start the build (the retry of a failed stage, the resume of an interrupted build): it
    begins at the first stage not built.

    Raises:
        Conflict (409): a build is already running.
    """
    if not assets.start():
        raise Conflict("the demo assets are already building; wait for that build to end")
    return _public(assets, store)


def check_run_assets(assets, config: dict[str, Any], field: str = "preset") -> None:
    """Raise ``Conflict`` (409, code ``assets_not_ready``) when ``config`` needs demo assets
    that are not built yet (``workbench.worker.asset_status.run_refusal`` names them and the build)."""
    why = assets.refusal(config)
    if why is not None:
        raise Conflict(f"this run cannot start yet: {why}", field=field, code="assets_not_ready")

"""``GET /api/system``: device, VRAM and RAM totals, torch and CUDA versions;
``GET /api/limits/fields``: the live-limit fields' config paths and watermark pairs."""

from __future__ import annotations

from fastapi import APIRouter

from backend.api.deps import ProbeDep
from backend.limits import limit_fields
from backend.models import LimitFields, SystemInfo

router = APIRouter(prefix="/api", tags=["system"])


@router.get("/system", response_model=SystemInfo)
def system_info(probe: ProbeDep) -> dict:
    return probe.info()


@router.get("/limits/fields", response_model=LimitFields)
def live_limit_fields() -> dict:
    """Every live-limit field's config path and the (high, low) watermark pairs, so that the
    dashboard binds its inputs without a table of its own."""
    return limit_fields()

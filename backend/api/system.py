"""``GET /api/system``: device, VRAM and RAM totals, torch and CUDA versions."""

from __future__ import annotations

from fastapi import APIRouter

from backend.api.deps import ProbeDep
from backend.models import SystemInfo

router = APIRouter(prefix="/api", tags=["system"])


@router.get("/system", response_model=SystemInfo)
def system_info(probe: ProbeDep) -> dict:
    return probe.info()

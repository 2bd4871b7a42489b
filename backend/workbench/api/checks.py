"""``POST /api/runs/check``: what ``POST /api/runs`` would refuse in a run request, every problem
at once, starting nothing. The New run page asks it as a field changes, so that its errors show
beside the fields while they are typed, by the server's own rules (``validate_config``: the
preset schema, then the folders), not a copy of them in JavaScript.
"""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field

from workbench.api.deps import StoreDep
from workbench.api.errors import NotFound
from workbench.api.models import ScanRequest
from workbench.api.openapi import errors
from workbench.services.presets import request_problems

router = APIRouter(prefix="/api/runs", tags=["runs"])


class CheckProblem(BaseModel):
    field: str = Field(description="JSON path into the request (overrides.max_steps)")
    message: str


class RunCheck(BaseModel):
    """``POST /api/runs/check``: ``valid`` when ``POST /api/runs`` would queue the request (the
    demo assets aside: ``GET /api/assets`` says which presets wait for them)."""

    valid: bool
    problems: list[CheckProblem]


@router.post("/check", response_model=RunCheck, responses=errors(404))
def check_run(body: ScanRequest, store: StoreDep) -> dict:
    """What ``POST /api/runs`` would refuse in a run of ``preset`` with ``overrides``, every
    problem at once (``workbench.services.presets.request_problems``); nothing is queued or stored.

    Raises:
        NotFound (404): no preset of that name (``field: "preset"``).
    """
    stored = store.get_preset(body.preset)
    if stored is None:
        raise NotFound(f"no preset named {body.preset!r}", field="preset")
    problems = request_problems(stored["config"], body.overrides)
    return {"valid": not problems, "problems": problems}

"""``POST /api/runs/check``: what ``POST /api/runs`` would refuse in a run request, every problem
at once, starting nothing. The New run page asks it as a field changes, so that its errors show
beside the fields while they are typed, by the server's own rules (``validate_config``: the
preset schema, then the folders), not a copy of them in JavaScript.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field

from backend.api.deps import StoreDep
from backend.api.errors import Invalid, NotFound
from backend.api.models import ScanRequest
from backend.api.openapi import errors
from backend.services.presets import validate_config
from contract.preset.overrides import apply_overrides

router = APIRouter(prefix="/api/runs", tags=["runs"])

FOLDER_SECTIONS = ("model", "data", "text_encoder")
"""The top-level keys that hold the folders a run reads (``Preset.folders``): the sections kept
as given when the folders are checked past other sections' problems."""

_TOP = re.compile(r"^([^.\[]+)")


class CheckProblem(BaseModel):
    field: str = Field(description="JSON path into the request (overrides.max_steps)")
    message: str


class RunCheck(BaseModel):
    """``POST /api/runs/check``: ``valid`` when ``POST /api/runs`` would queue the request (the
    demo assets aside: ``GET /api/assets`` says which presets wait for them)."""

    valid: bool
    problems: list[CheckProblem]


def _problems(config: dict[str, Any], prefix: str) -> list[dict[str, str]]:
    """Every problem ``validate_config`` finds in ``config`` (one round: the schema's, else the
    folders'), as ``{field, message}``."""
    try:
        validate_config(config, prefix)
    except Invalid as exc:
        listed = [d for d in exc.details if isinstance(d, dict) and d.get("field")]
        return listed or [{"field": exc.field or prefix, "message": exc.message}]
    return []


def _top_key(field: str, prefix: str) -> str | None:
    """``overrides.memory.stagehand.x`` -> ``memory`` (None for the prefix itself)."""
    match = _TOP.match(field.removeprefix(prefix).lstrip("."))
    return match.group(1) if match else None


def check_request(stored: dict[str, Any], overrides: dict[str, Any]) -> list[dict[str, str]]:
    """The problems of a run of the preset config ``stored`` with ``overrides``: the schema's
    (every one) and the folders'. ``validate_config`` checks the folders only once the schema
    holds, which made a form show a missing folder one Start after a bad step count; here the
    folders are checked too with each section at fault put back as the preset has it (the
    folder sections kept as given).

    Returns:
        ``[{field, message}]``, ``field`` a JSON path under ``overrides`` (``preset`` when there
        are no overrides); empty when ``POST /api/runs`` would take the request.
    """
    prefix = "overrides" if overrides else "preset"
    merged = apply_overrides(stored, overrides)
    problems = _problems(merged, prefix)
    at_fault = {_top_key(p["field"], prefix) for p in problems}
    if not problems or None in at_fault or at_fault & set(FOLDER_SECTIONS):
        return problems
    repaired = copy.deepcopy(merged)
    for key in at_fault:
        if key in stored:
            repaired[key] = copy.deepcopy(stored[key])
        else:
            repaired.pop(key, None)
    named = {p["field"] for p in problems}
    more = [p for p in _problems(repaired, prefix) if p["field"] not in named]
    # Only the folders' problems: anything else came from the sections put back.
    return problems + [p for p in more if _top_key(p["field"], prefix) in FOLDER_SECTIONS]


@router.post("/check", response_model=RunCheck, responses=errors(404))
def check_run(body: ScanRequest, store: StoreDep) -> dict:
    """What ``POST /api/runs`` would refuse in a run of ``preset`` with ``overrides``, every
    problem at once (``check_request``); nothing is queued or stored.

    Raises:
        NotFound (404): no preset of that name (``field: "preset"``).
    """
    stored = store.get_preset(body.preset)
    if stored is None:
        raise NotFound(f"no preset named {body.preset!r}", field="preset")
    problems = check_request(stored["config"], body.overrides)
    return {"valid": not problems, "problems": problems}

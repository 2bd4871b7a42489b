"""Runs: create from a preset with overrides, list, get, notes/tags, cancel, delete, limits."""

from __future__ import annotations

import shutil
from pathlib import PurePosixPath
from typing import Annotated

from fastapi import APIRouter, Query, status

from stagehand.config.limits import watermark_problem
from workbench.api.assets import check_run_assets
from workbench.api.deps import (
    AssetsDep,
    SettingsDep,
    StoreDep,
    SupervisorDep,
    public_run,
    run_limits,
    run_row,
)
from workbench.api.errors import Conflict, Invalid
from workbench.api.models import (
    LimitsAccepted,
    LimitsPublic,
    LimitsUpdate,
    RunCreate,
    RunId,
    RunPublic,
    RunsPublic,
    RunUpdate,
)
from workbench.api.openapi import errors
from workbench.contract.control import LIMITS
from workbench.contract.status import ACTIVE, RunStatus
from workbench.services.presets import run_config
from workbench.services.run_files import write_run_config

router = APIRouter(prefix="/api/runs", tags=["runs"])


@router.get("", response_model=RunsPublic)
def list_runs(
    store: StoreDep,
    status: Annotated[RunStatus | None, Query()] = None,
    preset: Annotated[str | None, Query(max_length=64)] = None,
    tag: Annotated[str | None, Query(max_length=40)] = None,
    group: Annotated[int | None, Query(ge=1, le=2**62, description="a tune's id")] = None,
) -> dict:
    data = [public_run(store, r) for r in store.list_runs(status, preset, tag, group)]
    return {"data": data, "count": len(data)}


@router.post(
    "",
    response_model=RunPublic,
    status_code=status.HTTP_201_CREATED,
    responses=errors(404, 409),
)
def create_run(
    body: RunCreate,
    store: StoreDep,
    supervisor: SupervisorDep,
    settings: SettingsDep,
    assets: AssetsDep,
) -> dict:
    config = run_config(store, body.preset, body.overrides)
    check_run_assets(assets, config)
    run_id = store.create_run(body.name or body.preset, body.preset, config, body.device)
    if body.name is None:
        store.update_run(run_id, name=default_name(body.preset, config, run_id))
    write_run_config(settings.runs_dir / str(run_id), config)
    supervisor.wake()
    return public_run(store, run_row(store, run_id))


def default_name(preset: str, config: dict, run_id: int) -> str:
    """The name of a run created without one: the model folder's name (else the preset's), the
    data folder's, then the id (``FLUX.1-dev on photos-7``, ``default-3``). A run of the demo
    preset on a user's folders named ``default-7`` read as the demo in the runs list."""

    def folder(section: object) -> str | None:
        path = section.get("path") if isinstance(section, dict) else None
        if not isinstance(path, str) or not path.strip("/"):
            return None
        name = PurePosixPath(path.rstrip("/")).name
        return "".join(c for c in name if c.isprintable()).replace("..", ".")[:40] or None

    model = folder(config.get("model")) or preset
    data = folder(config.get("data"))
    return f"{model} on {data}-{run_id}" if data else f"{model}-{run_id}"


@router.get("/{run_id}", response_model=RunPublic, responses=errors(404))
def get_run(run_id: RunId, store: StoreDep) -> dict:
    return public_run(store, run_row(store, run_id))


@router.patch("/{run_id}", response_model=RunPublic, responses=errors(404))
def update_run(run_id: RunId, body: RunUpdate, store: StoreDep) -> dict:
    run_row(store, run_id)
    if body.notes is not None:
        store.update_run(run_id, notes=body.notes)
    if body.name is not None:
        store.update_run(run_id, name=body.name)
    if body.tags is not None:
        store.set_tags(run_id, body.tags)
    return public_run(store, run_row(store, run_id))


@router.post("/{run_id}/cancel", response_model=RunPublic, responses=errors(404, 409))
def cancel_run(run_id: RunId, store: StoreDep, supervisor: SupervisorDep) -> dict:
    run_row(store, run_id)
    supervisor.cancel(run_id)
    return public_run(store, run_row(store, run_id))


@router.get("/{run_id}/log", responses=errors(404))
def get_log(run_id: RunId, store: StoreDep, supervisor: SupervisorDep) -> dict:
    """The end of the worker's own output (its progress lines, warnings), while it runs and
    after: ``{text}`` (null when the worker wrote none)."""
    run_row(store, run_id)
    return {"text": supervisor.log_tail(run_id)}


@router.post("/{run_id}/resume", response_model=RunPublic, responses=errors(404, 409))
def resume_run(run_id: RunId, store: StoreDep, supervisor: SupervisorDep) -> dict:
    """Queue a run that stopped before its end (failed, cancelled, killed, crashed) to continue
    from its last checkpoint, as the same run; 409 naming ``id`` otherwise."""
    run_row(store, run_id)
    supervisor.resume(run_id)
    return public_run(store, run_row(store, run_id))


@router.delete("/{run_id}", status_code=status.HTTP_204_NO_CONTENT, responses=errors(404, 409))
def delete_run(run_id: RunId, store: StoreDep, supervisor: SupervisorDep, settings: SettingsDep):
    run = run_row(store, run_id)
    if run["status"] in (*ACTIVE, RunStatus.QUEUED) or supervisor.is_live(run_id):
        raise Conflict(f"run {run_id} is {run['status']}; cancel it before deleting", field="id")
    run_dir = (settings.runs_dir / str(run_id)).resolve()
    if run_dir.parent == settings.runs_dir.resolve() and run_dir.is_dir():
        shutil.rmtree(run_dir, ignore_errors=True)
    store.delete_run(run_id)


@router.patch(
    "/{run_id}/limits",
    response_model=LimitsAccepted,
    status_code=202,
    responses=errors(404, 409),
)
def set_limits(
    run_id: RunId, body: LimitsUpdate, store: StoreDep, supervisor: SupervisorDep
) -> dict:
    """Forward live limits to the worker's control dir; the worker acknowledges with a
    ``strategy/limits_applied`` record carrying the returned ``request_id`` (or refuses with
    a ``trainer/event`` ``control_rejected`` one). A low watermark that would be above its high
    one once folded into the limits in force is a 422 naming the field given."""
    limits = body.given()
    if not limits:
        raise Invalid("no limits given: set at least one LiveLimits field", field=None)
    run = run_row(store, run_id)
    if run["status"] not in ACTIVE or not supervisor.is_live(run_id):
        raise Conflict(f"run {run_id} is {run['status']}; limits apply to running runs", field="id")
    problem = watermark_problem(run_limits(store, run)["now"], limits)
    if problem is not None:
        field, sentence = problem
        raise Invalid(sentence, field=field)
    request_id = supervisor.send_control(run_id, {"command": LIMITS, "limits": limits})
    return {"request_id": request_id}


@router.get("/{run_id}/limits", response_model=LimitsPublic, responses=errors(404))
def get_limits(run_id: RunId, store: StoreDep) -> dict:
    """The live limits of the run: those it started with (``preset``: its config, with the
    runtime's defaults), those in force now (``now``), each field's config path (``paths``)
    and every change the worker applied (``history``, in seq order)."""
    return run_limits(store, run_row(store, run_id))

"""Typed dependencies: the services built in ``lifespan``, reached through ``app.state``.

Tests may replace any of them with ``app.dependency_overrides[get_store] = ...``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import Depends
from starlette.requests import HTTPConnection

from stagehand.config.records import LIMITS_APPLIED
from workbench.api.errors import NotFound
from workbench.api.models import run_public
from workbench.contract.status import ACTIVE
from workbench.services.assets import AssetBuild
from workbench.services.calibration import Calibrator
from workbench.services.hub import Hub
from workbench.services.limits import effective_limits
from workbench.services.settings import Settings
from workbench.services.supervisor import Supervisor
from workbench.services.system import SystemProbe
from workbench.store import Store


def get_store(conn: HTTPConnection) -> Store:
    return conn.app.state.store


def get_supervisor(conn: HTTPConnection) -> Supervisor:
    return conn.app.state.supervisor


def get_hub(conn: HTTPConnection) -> Hub:
    return conn.app.state.hub


def get_settings(conn: HTTPConnection) -> Settings:
    return conn.app.state.settings


def get_probe(conn: HTTPConnection) -> SystemProbe:
    return conn.app.state.probe


def get_assets(conn: HTTPConnection) -> AssetBuild:
    return conn.app.state.assets


def get_calibrator(conn: HTTPConnection) -> Calibrator:
    return conn.app.state.calibrator


StoreDep = Annotated[Store, Depends(get_store)]
SupervisorDep = Annotated[Supervisor, Depends(get_supervisor)]
HubDep = Annotated[Hub, Depends(get_hub)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
ProbeDep = Annotated[SystemProbe, Depends(get_probe)]
AssetsDep = Annotated[AssetBuild, Depends(get_assets)]
CalibratorDep = Annotated[Calibrator, Depends(get_calibrator)]


def run_row(store: Store, run_id: int) -> dict[str, Any]:
    """The run's store row; raises ``NotFound``."""
    row = store.get_run(run_id)
    if row is None:
        raise NotFound(f"no run with id {run_id}", field="id")
    return row


def public_run(store: Store, row: dict[str, Any]) -> dict[str, Any]:
    """The API's Run, with live summary figures while the run is active."""
    live = row["status"] in ACTIVE or not row.get("summary")
    return run_public(row, store.summary(row["id"]) if live else None)


def run_limits(store: Store, row: dict[str, Any]) -> dict[str, Any]:
    """The run's limits (``workbench.services.limits.effective_limits``): its config folded with every
    ``strategy/limits_applied`` record the worker wrote, in seq order."""
    applied: list[dict[str, Any]] = []
    since = -1
    while page := store.telemetry_lines(row["id"], since, 10_000, *LIMITS_APPLIED):
        applied += [json.loads(line) for _, line in page]
        since = page[-1][0]
    return effective_limits(row["config"], applied)

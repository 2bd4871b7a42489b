"""Presets: built-in (read-only, from ``presets/*.json``) and user presets (editable)."""

from __future__ import annotations

import sqlite3

from fastapi import APIRouter, Path, status

from workbench.api.deps import StoreDep
from workbench.api.errors import Conflict, NotFound, ReadOnly
from workbench.api.models import (
    PRESET_NAME_SCHEMA,
    PresetCreate,
    PresetDuplicate,
    PresetPublic,
    PresetsPublic,
    PresetUpdate,
)
from workbench.api.openapi import errors
from workbench.services.presets import validate_config

router = APIRouter(prefix="/api/presets", tags=["presets"])
PresetName = Path(max_length=64, json_schema_extra=PRESET_NAME_SCHEMA)


def _get(store, name: str) -> dict:
    preset = store.get_preset(name)
    if preset is None:
        raise NotFound(f"no preset named {name!r}", field="name")
    return preset


@router.get("", response_model=PresetsPublic)
def list_presets(store: StoreDep) -> dict:
    data = store.list_presets()
    return {"data": data, "count": len(data)}


@router.post(
    "", response_model=PresetPublic, status_code=status.HTTP_201_CREATED, responses=errors(409)
)
def create_preset(body: PresetCreate, store: StoreDep) -> dict:
    config = validate_config(body.config, "config")
    try:
        store.insert_preset(body.name, config, body.description)
    except sqlite3.IntegrityError:
        raise Conflict(f"a preset named {body.name!r} exists", field="name") from None
    return _get(store, body.name)


@router.get("/{name}", response_model=PresetPublic, responses=errors(404))
def get_preset(store: StoreDep, name: str = PresetName) -> dict:
    return _get(store, name)


@router.put("/{name}", response_model=PresetPublic, responses=errors(404))
def update_preset(body: PresetUpdate, store: StoreDep, name: str = PresetName) -> dict:
    preset = _get(store, name)
    if preset["builtin"]:
        raise ReadOnly(f"preset {name!r} is built in; duplicate it to edit a copy", field="name")
    config = validate_config(body.config, "config")
    description = preset["description"] if body.description is None else body.description
    store.update_preset(name, config, description)
    return _get(store, name)


@router.delete("/{name}", status_code=status.HTTP_204_NO_CONTENT, responses=errors(404))
def delete_preset(store: StoreDep, name: str = PresetName) -> None:
    if _get(store, name)["builtin"]:
        raise ReadOnly(f"preset {name!r} is built in and cannot be deleted", field="name")
    store.delete_preset(name)


@router.post(
    "/{name}/duplicate", response_model=PresetPublic, status_code=201, responses=errors(404, 409)
)
def duplicate_preset(body: PresetDuplicate, store: StoreDep, name: str = PresetName) -> dict:
    source = _get(store, name)
    try:
        store.insert_preset(body.name, source["config"], source["description"])
    except sqlite3.IntegrityError:
        raise Conflict(f"a preset named {body.name!r} exists", field="name") from None
    return _get(store, body.name)

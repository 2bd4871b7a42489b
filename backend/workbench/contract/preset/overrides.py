"""A run's overrides applied to its preset (``apply_overrides``): the config the server validates
for a run, a data scan and a tune. Two rules on top of the deep merge (``merge_overrides``):

- A folder the overrides name (``model.path``, ``data.path``) where the preset names none drops
  the preset's fields bound to that folder (``bound_fields``: the schema's ``BOUND_TO`` marks),
  unless the overrides set them too. They describe the preset's own model or data: the digits
  demo's ``data.limit`` 512 and 16 caption tokens, its digit prompts, would otherwise cap and
  truncate a user's folder and caption its samples with digits, and ``data.factory`` would clash
  with the folder.
- ``null`` removes the preset's key, so the field takes its default (a preset's key could not be
  removed otherwise: overrides only add and replace). A field that takes null as a value other
  than its default (``grad_clip``: no clipping, not 1.0) gets null.
"""

from __future__ import annotations

import copy
import functools
import typing
from typing import Any

from pydantic import BaseModel

from workbench.contract.preset.schema import BOUND_TO, Preset


def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model a field of this annotation holds (``X`` of ``X | None``), or None."""
    for kind in (annotation, *typing.get_args(annotation)):
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            return kind
    return None


@functools.cache
def bound_fields() -> dict[str, tuple[str, ...]]:
    """Folder field (``"data.path"``) -> the JSON paths of the fields bound to it
    (``"data.factory"``, ..., ``"samples.prompts"``), read from the schema's ``BOUND_TO`` marks."""
    found: dict[str, list[str]] = {}

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            extra = field.json_schema_extra
            if isinstance(extra, dict) and BOUND_TO in extra:
                found.setdefault(str(extra[BOUND_TO]), []).append(prefix + name)
            sub = _submodel(field.annotation)
            if sub is not None:
                walk(sub, f"{prefix}{name}.")

    walk(Preset, "")
    return {folder: tuple(paths) for folder, paths in found.items()}


def _keeps_null(keys: tuple[str, ...]) -> bool:
    """Whether null at ``keys`` is a value rather than a removal: the field takes null and its
    default is another value; True for a path the schema does not have (the null is kept, so
    that validation names the unknown field)."""
    model: type[BaseModel] | None = Preset
    for i, key in enumerate(keys):
        field = model.model_fields.get(key) if model is not None else None
        if field is None:
            return True
        if i == len(keys) - 1:
            nullable = type(None) in typing.get_args(field.annotation)
            return nullable and not field.is_required() and field.get_default() is not None
        model = _submodel(field.annotation)
    return True


def _get(config: dict[str, Any], path: str) -> Any:
    node: Any = config
    for key in path.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return node


def _drop(config: dict[str, Any], path: str) -> None:
    *parents, last = path.split(".")
    node: Any = config
    for key in parents:
        node = node.get(key) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node.pop(last, None)


def _merge(base: dict[str, Any], overrides: dict[str, Any], keys: tuple[str, ...]):
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        path = (*keys, key)
        if value is None and not _keeps_null(path):
            out.pop(key, None)
        elif isinstance(value, dict):
            inner = out.get(key)
            out[key] = _merge(inner if isinstance(inner, dict) else {}, value, path)
        else:
            out[key] = copy.deepcopy(value)
    return out


def apply_overrides(preset: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """The config of a run of ``preset`` with ``overrides`` (both JSON objects, left unchanged):
    merged deep, a folder dropping the preset's fields bound to it and null removing a key (see
    the module doc). Not validated: the caller validates the result as a whole, so that every
    problem is reported at once."""
    base = copy.deepcopy(preset)
    for folder, paths in bound_fields().items():
        if isinstance(_get(overrides, folder), str) and _get(preset, folder) is None:
            for path in paths:
                _drop(base, path)
    return _merge(base, overrides, ())

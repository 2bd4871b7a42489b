"""Preset configs: the built-in ones from the repo's ``presets/*.json``, validation, overrides.

Validation is ``workbench.worker.preset.validate_preset`` (torch-free) when that module is present;
without it only the JSON shape is checked (an object). Its errors become 422s whose ``field``
is the JSON path into the request (``config.memory...`` or ``overrides.memory...``).
"""

from __future__ import annotations

import copy
import importlib
import json
import logging
import re
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from workbench.api.errors import Invalid, NotFound, from_validation
from workbench.api.models import NAME_RE
from workbench.contract.preset.overrides import apply_overrides
from workbench.store import Store

log = logging.getLogger("workbench.services.presets")


def _preset_module():
    try:
        module = importlib.import_module("workbench.worker.preset")
    except ImportError:  # the trainer's module is optional for the backend
        return None
    return module if hasattr(module, "validate_preset") else None


def validate_config(config: Any, prefix: str) -> dict[str, Any]:
    """Check ``config`` as the worker will (schema, then that named folders exist and are
    absolute paths: the worker runs in the repository folder, not the server's).

    Returns the config unchanged (the worker resolves defaults itself and writes the resolved
    config into the run dir). Raises ``Invalid`` whose ``field`` is ``prefix.<JSON path>`` of
    the first problem and whose ``details`` list every problem.
    """
    if not isinstance(config, dict):
        raise Invalid(
            f"{prefix}: expected a JSON object, got {type(config).__name__}", field=prefix
        )
    module = _preset_module()
    if module is None:
        return config
    try:
        preset = module.validate_preset(copy.deepcopy(config))
        if hasattr(preset, "check_paths"):
            preset.check_paths(absolute=True)
    except ValidationError as exc:
        raise from_validation(exc, prefix) from None
    except ValueError as exc:
        problems = getattr(exc, "problems", None)
        if not problems:
            raise Invalid(f"{prefix}: {exc}", field=prefix) from None
        details = [
            {"field": _join(prefix, p.get("path")), "message": p["message"]} for p in problems
        ]
        first = details[0]
        raise Invalid(
            f"{first['field']}: {first['message']}",
            field=first["field"],
            details=details,
            code="validation_error",
        ) from None
    return config


def run_config(store: Store, preset: str, overrides: dict[str, Any]) -> dict[str, Any]:
    """The config a run of ``preset`` with ``overrides`` would get (``apply_overrides``: a folder
    drops the preset's fields bound to it, null removes a key), validated (``validate_config``).

    Raises:
        NotFound: no preset of that name (``field: "preset"``).
        Invalid: the merged config is not valid (``field``: ``overrides.<path>``, or
            ``preset.<path>`` without overrides).
    """
    stored = store.get_preset(preset)
    if stored is None:
        raise NotFound(f"no preset named {preset!r}", field="preset")
    merged = apply_overrides(stored["config"], overrides)
    try:
        return validate_config(merged, "overrides" if overrides else "preset")
    except Invalid as exc:  # every problem at once: the folders' too (request_problems)
        named = {d.get("field") for d in exc.details if isinstance(d, dict)} | {exc.field}
        more = [p for p in request_problems(stored["config"], overrides) if p["field"] not in named]
        if not more:
            raise
        details = [*(exc.details or [{"field": exc.field, "message": exc.message}]), *more]
        raise Invalid(exc.message, field=exc.field, details=details, code=exc.code) from None


FOLDER_SECTIONS = ("model", "data", "text_encoder")
"""The top-level keys that hold the folders a run reads (``Preset.folders``): the sections kept
as given when the folders are checked past other sections' problems."""

_TOP = re.compile(r"^([^.\[]+)")


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


def request_problems(stored: dict[str, Any], overrides: dict[str, Any]) -> list[dict[str, str]]:
    """The problems of a run of the preset config ``stored`` with ``overrides``: the schema's
    (every one) and the folders'. ``validate_config`` checks the folders only once the schema
    holds, which made a form show a missing folder one Start after a bad step count; here the
    folders are checked too with each section at fault put back as the preset has it (the
    folder sections kept as given). ``POST /api/runs`` (``run_config``) and ``POST
    /api/runs/check`` answer with these.

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


def normalized(config: dict[str, Any]) -> dict[str, Any]:
    """The config with the worker's defaults filled in (for config diffs); raw if invalid."""
    module = _preset_module()
    if module is None:
        return config
    try:
        return module.validate_preset(copy.deepcopy(config)).model_dump(mode="json")
    except (ValueError, AttributeError):
        return config


def _join(prefix: str, path: str | None) -> str:
    if not path or path.startswith("("):  # "(top level)", "(file)"
        return prefix
    return f"{prefix}{path}" if path.startswith("[") else f"{prefix}.{path}"


def load_builtins(store: Store, presets_dir: Path) -> list[str]:
    """Load ``presets_dir/*.json`` as read-only presets; returns the names loaded.

    A file that is not valid JSON or not a valid preset is logged and skipped, never fatal.
    """
    names = []
    for path in sorted(Path(presets_dir).glob("*.json")):
        name = path.stem
        if not NAME_RE.match(name):
            log.warning("skipping preset file %s: not a valid preset name", path)
            continue
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            log.warning("skipping preset file %s: %s", path, exc)
            continue
        if not isinstance(config, dict):
            log.warning("skipping preset file %s: not a JSON object", path)
            continue
        description = (
            config.get("description") if isinstance(config.get("description"), str) else ""
        )
        store.upsert_builtin_preset(name, config, description)
        names.append(name)
    store.drop_builtins_except(names)
    return names

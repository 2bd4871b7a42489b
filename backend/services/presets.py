"""Preset configs: the built-in ones from the repo's ``presets/*.json``, validation, overrides.

Validation is ``worker.preset.validate_preset`` (torch-free) when that module is present;
without it only the JSON shape is checked (an object). Its errors become 422s whose ``field``
is the JSON path into the request (``config.memory...`` or ``overrides.memory...``).
"""

from __future__ import annotations

import copy
import importlib
import json
import logging
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from backend.api.errors import Invalid, NotFound, from_validation
from backend.api.models import NAME_RE
from backend.store import Store
from contract.preset.overrides import apply_overrides

log = logging.getLogger("backend.services.presets")


def _preset_module():
    try:
        module = importlib.import_module("worker.preset")
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
    return validate_config(merged, "overrides" if overrides else "preset")


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

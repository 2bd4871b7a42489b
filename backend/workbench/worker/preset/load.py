"""Validating and loading presets: ``validate_preset`` (every problem reported at its JSON
path), ``load_preset`` and ``list_presets`` (the built-in ``presets/*.json``)."""

from __future__ import annotations

import json
import math
import os
import re
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ValidationError,
)

from stagehand.config.memory import RETIRED_STAGEHAND_FIELDS
from workbench.contract.preset.errors import PresetError, found_text
from workbench.contract.preset.schema import PRESETS_DIR, Preset

# -- errors ------------------------------------------------------------------------------------
_TYPE_BRANCHES = {"int", "float", "str", "bool", "none", "list", "dict", "tuple", "literal"}


def _json_path(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for item in loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
            continue
        text = str(item)
        # Union branches (``int``, ``tuple[int, ...]``, ``function-after[...]``) are not fields.
        if any(c in text for c in "[(-") or text.lower() in _TYPE_BRANCHES:
            continue
        parts.append(("." if parts else "") + text)
    return "".join(parts) or "(top level)"


def _expected(error: dict[str, Any]) -> str:
    kind, msg = error["type"], error["msg"]
    if kind == "extra_forbidden":
        return "no such field (unknown field)"
    if kind == "missing":
        return "this required field"
    prefixes = ("Input should be ", "Value error, ", "Assertion failed, ")
    prefixes += ("String should have ", "List should have ", "Tuple should have ")
    for prefix in prefixes:
        if msg.startswith(prefix):
            return msg[len(prefix) :]
    return msg


# NOTE [ Cross-field errors ]
# pydantic reports a ValueError raised in a model validator at the model, so a rule between two
# fields (low watermark above high) would name the section, not the field. Our validators raise
# ``field_error``, located at the field. runtime/stagehand/config/memory.py's validators raise plain ValueErrors
# whose sentence starts with the field at fault ("vram_low_watermark_mb (16000) must not be
# above ..."): ``_cross_field`` locates those at that field when it is one of the model's.


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model validated at ``loc`` under ``Preset`` (None if not a model)."""
    model: type[BaseModel] = Preset
    for part in loc:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        kinds = [field.annotation, *typing.get_args(field.annotation)]
        found = [k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)]
        if not found:
            return None
        model = found[0]
    return model


def _cross_field(err: dict[str, Any]) -> tuple[tuple[Any, ...], Any] | None:
    """``(loc, value)`` of the field a model-level rule's sentence names first, or None."""
    data = err.get("input")
    if err["type"] != "value_error" or not isinstance(data, dict):
        return None
    model = _model_at(tuple(err["loc"]))
    first = re.match(r"[A-Za-z_]\w*", _expected(err))
    if model is None or first is None or first.group() not in model.model_fields:
        return None
    field = first.group()
    return (*err["loc"], field), data.get(field, model.model_fields[field].default)


def problems_of(exc: ValidationError) -> list[dict[str, Any]]:
    """``[{path, found, expected, message}]`` for each error of a pydantic ``ValidationError``.

    A rule between fields is reported at the field at fault, with its sentence as ``message``
    (NOTE [ Cross-field errors ]). A value no branch of a union takes is one problem whose
    ``expected`` lists the branches (``greater than or equal to 0, or 'auto'``): pydantic reports
    a line per branch, and a line alone reads as the only thing the field takes.
    """
    seen, out = set(), []
    branches: dict[tuple[str, str], dict[str, Any]] = {}
    for err in exc.errors():
        loc, value, sentence = tuple(err["loc"]), err.get("input"), None
        located = _cross_field(err)
        if located is not None:
            loc, value = located
        if located is not None or err["type"] == "cross_field":
            sentence = _expected(err)
        path = _json_path(loc)
        found = "nothing" if err["type"] == "missing" else found_text(value)
        item = (path, found, _expected(err))
        if item in seen:
            continue
        seen.add(item)
        union = branches.get((path, found))
        if union is not None and sentence is None:
            union["expected"] += f", or {item[2]}"
            continue
        problem = {"path": path, "found": found, "expected": item[2]}
        out.append({**problem, "message": sentence} if sentence else problem)
        if sentence is None:
            branches[(path, found)] = out[-1]
    return out


def _non_finite(value: Any, loc: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], float]]:
    """``(loc, number)`` of each ``NaN`` or infinity in ``value`` (parsed JSON: Python's json
    reads both)."""
    if isinstance(value, float) and not math.isfinite(value):
        yield loc, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _non_finite(item, (*loc, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _non_finite(item, (*loc, i))


def _with_strategy(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with ``memory.strategy`` filled in when the seed leaves it out (the Flux 2048
    seed sets layer-offload fields without naming the strategy), and without the seed's
    ``RETIRED_STAGEHAND_FIELDS``."""
    mem = data.get("memory")
    if not isinstance(mem, dict):
        return data
    sh = mem.get("stagehand")
    if isinstance(sh, dict) and any(k in sh for k in RETIRED_STAGEHAND_FIELDS):
        sh = {k: v for k, v in sh.items() if k not in RETIRED_STAGEHAND_FIELDS}
        mem = {**mem, "stagehand": sh}
        data = {**data, "memory": mem}
    if "strategy" in mem:
        return data
    offload = ("layer_offload_fraction", "enable_activation_offloading")
    strategy = "layer_offload" if any(k in mem for k in offload) else None
    if strategy is None:
        strategy = "stagehand" if "stagehand" in mem else "none"
    return {**data, "memory": {**mem, "strategy": strategy}}


def validate_preset(data: Any) -> Preset:
    """Validate a preset's JSON object, strictly: numbers must be finite JSON numbers (not
    ``true``, not ``"4"``); an integer field takes no fraction.

    Raises:
        PresetError: listing each problem as ``JSON.path: found <value>, expected <what>``.
    """
    if not isinstance(data, dict):
        raise PresetError(
            [{"path": "(top level)", "found": found_text(data), "expected": "an object"}]
        )
    problems = [
        {"path": _json_path(loc), "found": found_text(number), "expected": "a finite number"}
        for loc, number in _non_finite(data)
    ]
    # JSON mode: strict numbers, while JSON arrays still fill tuples (Python's strict mode
    # would refuse a list for ``betas``). No model validator may run "before": it would hand
    # the rest of the validation a Python dict (hence ``_with_strategy`` here).
    text = json.dumps(_with_strategy(data), default=str)
    try:
        preset = Preset.model_validate_json(text, strict=True)
    except ValidationError as exc:
        named = {p["path"] for p in problems}
        problems += [p for p in problems_of(exc) if p["path"] not in named]
    if problems:
        raise PresetError(problems)
    return preset


def list_presets() -> list[str]:
    """Names of the built-in presets, sorted."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def load_preset(name_or_path: str | os.PathLike[str]) -> tuple[str, dict[str, Any]]:
    """``(name, raw JSON object)`` of a built-in preset name or a path to a JSON file.

    Raises:
        FileNotFoundError: neither a file nor a built-in preset (lists the built-in names).
        PresetError: the file is not valid JSON.
    """
    path = Path(name_or_path).expanduser()
    if not path.is_file():
        builtin = PRESETS_DIR / f"{name_or_path}.json"
        if not builtin.is_file():
            raise FileNotFoundError(
                f"no preset file {str(name_or_path)!r} and no built-in preset of that name "
                f"(built-in: {', '.join(list_presets())})"
            )
        path = builtin
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise PresetError(
            [
                {
                    "path": "(file)",
                    "found": f"{path} line {exc.lineno}",
                    "expected": f"JSON ({exc.msg})",
                }
            ]
        ) from None
    name = data.get("name") if isinstance(data, dict) else None
    return str(name or path.stem), data

"""The live limits a run is under: its config's, folded with what the worker applied.

A run starts with the limits of its config's ``memory`` section (the runtime's defaults where
the config says nothing: ``stagehand.config.memory.MemoryConfig``, which imports no torch; None for the
prefetch window and copies in flight, which the runtime derives at the run's start from the
blocks and the device, ``runtime/stagehand/weights/defaults.py``). Each ``strategy/limits_applied``
record's ``changed`` (``{field: [old, new]}``) then moves the limits in force, in seq order.
The fields, their config paths and the watermark rule are ``stagehand.config.limits``'. Only the
runtimes that are on have limits: a field of a runtime that is off is absent, and the worker refuses it (a ``trainer/event`` ``control_rejected``).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from stagehand.config.limits import ACTIVATION_FIELDS, PAIRS, PATHS, WEIGHT_FIELDS
from stagehand.config.memory import MemoryConfig


def config_limits(config: dict[str, Any]) -> dict[str, float | int]:
    """The limits a run with ``config`` starts under, for the runtimes that are on (an empty
    dict when its memory section is not valid or streams nothing)."""
    try:
        memory = MemoryConfig.model_validate(config.get("memory") or {})
    except ValidationError:
        return {}
    section = memory.stagehand
    if memory.strategy != "stagehand" or section is None:
        return {}
    out: dict[str, float | int] = {}
    if section.weight_streaming:
        out.update({field: getattr(section, field) for field in WEIGHT_FIELDS})
    act = section.activation_stagehand
    if act is not None and act.enabled:
        out.update({field: getattr(act, name) for field, name in ACTIVATION_FIELDS.items()})
    # "auto" is a figure only once the worker resolved it: its limits_applied record (request
    # id "auto") carries the MB values into "now".
    return {field: value for field, value in out.items() if value != "auto"}


def effective_limits(config: dict[str, Any], applied: list[dict[str, Any]]) -> dict[str, Any]:
    """``{preset, now, paths, history}``: the limits the run started under (``preset``), those
    in force after every record of ``applied`` (``strategy/limits_applied`` records, in seq
    order), each field's config path (``paths``), the watermark pairs (``pairs``), and ``history: [{seq, step, time, request_id,
    changed}]`` (``changed``: ``{field: [old, new]}``, as the worker wrote it)."""
    preset = config_limits(config)
    now = dict(preset)
    history = []
    for rec in applied:
        changed = {
            field: pair
            for field, pair in (rec.get("changed") or {}).items()
            if field in PATHS and isinstance(pair, list) and len(pair) == 2
        }
        for field, (_, new) in changed.items():
            now[field] = new
        history.append(
            {
                "seq": rec.get("seq"),
                "step": rec.get("step"),
                "time": rec.get("time"),
                "request_id": rec.get("request_id"),
                "changed": changed,
            }
        )
    return {"preset": preset, "now": now, **limit_fields(), "history": history}


def limit_fields() -> dict[str, Any]:
    """``{paths, pairs}``: each live-limit field's config path and the watermark pairs, for the
    dashboard (``stagehand.config.limits``)."""
    return {"paths": dict(PATHS), "pairs": [list(pair) for pair in PAIRS]}

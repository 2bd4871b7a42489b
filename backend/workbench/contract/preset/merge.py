"""Overrides merged into a preset: the server's run and tune configs (``workbench.services.presets``,
``workbench.api.tunes``) and the planner's candidate limits (``workbench.plan.tune``)."""

from __future__ import annotations

import copy
from typing import Any


def merge_overrides(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` merged in: dicts merge key by key, anything else (lists,
    numbers, ``None``) replaces. Neither argument is changed; the result shares nothing with
    them (deep copies)."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_overrides(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out

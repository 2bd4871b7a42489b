"""``/static/js/contract.js`` carries what the dashboard must spell as the server does, rendered
from ``contract`` (``workbench.contract.javascript``): no page keeps a list of its own."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import get_args

from stagehand.config.limits import PAIRS, PATHS
from stagehand.config.memory import LiveLimits, MemoryConfig, SquareQConfig
from workbench.contract.preset import FAMILIES, MODEL_TYPES
from workbench.contract.status import ACTIVE, RESUMABLE, TERMINAL, RunStatus

FRONTEND = Path(__file__).resolve().parents[2] / "frontend" / "js"


def exports(api) -> dict[str, object]:
    """contract.js as served: each ``export const NAME = VALUE;`` as NAME -> VALUE (JSON; a
    ``new Set(...)`` as its list)."""
    res = api.get("/static/js/contract.js")
    assert res.status_code == 200 and res.headers["content-type"].startswith("text/javascript")
    found = {}
    for m in re.finditer(r"^export const (\w+) = (.*);$", res.text, re.M):
        value = re.fullmatch(r"new Set\((.*)\)", m[2])
        found[m[1]] = json.loads(value[1] if value else m[2])
    return found


def hard_coded(pattern: str) -> list[str]:
    """The dashboard's modules whose text matches ``pattern``."""
    return [
        str(p.relative_to(FRONTEND))
        for p in sorted(FRONTEND.rglob("*.js"))
        if re.search(pattern, p.read_text())
    ]


def test_the_dashboard_takes_the_status_names_from_the_server(api):
    """The statuses come from ``workbench.contract.status`` (a status added to the enum reaches the runs
    filter and every FINISHED check)."""
    found = exports(api)
    assert {k: found[k] for k in ("STATUSES", "ACTIVE", "RESUMABLE", "FINISHED")} == {
        "STATUSES": [s.value for s in RunStatus],
        "ACTIVE": [s.value for s in RunStatus if s in ACTIVE],
        "RESUMABLE": [s.value for s in RunStatus if s in RESUMABLE],
        "FINISHED": [s.value for s in RunStatus if s in TERMINAL],
    }
    assert hard_coded(r'\[\s*"(?:queued|succeeded|cancelled)"\s*,') == []


def test_the_dashboard_takes_limit_fields_and_allowed_values_from_the_server(api):
    """The live-limit fields (every ``LiveLimits`` field, with its config path), the SquareQ
    formats and strategies a config may name, the families and ``model_type`` spellings: each as
    its Python definition, and no module of the dashboard spells a list of them."""
    found = exports(api)
    assert found["LIMIT_PATHS"] == PATHS and list(PATHS) == list(LiveLimits.model_fields)
    assert found["LIMIT_PAIRS"] == [list(pair) for pair in PAIRS]
    formats = get_args(SquareQConfig.model_fields["format"].annotation)
    assert found["SQUAREQ_FORMATS"] == list(formats) == ["int8", "fp8_e4m3"]
    strategies = get_args(MemoryConfig.model_fields["strategy"].annotation)
    assert found["STRATEGIES"] == list(strategies) == ["none", "stagehand", "layer_offload"]
    assert found["FAMILIES"] == list(FAMILIES)
    assert found["MODEL_TYPES"] == MODEL_TYPES
    values = "|".join(found["SQUAREQ_FORMATS"] + found["STRATEGIES"])  # type: ignore[operator]
    assert hard_coded(rf'\[\s*(?:"",\s*)?"(?:{values})"\s*,') == []  # an array literal of them
    # A limit field is named by the server only; label tables key them (the panel's LABELS).
    assert hard_coded(r"limit:\s*true") == []

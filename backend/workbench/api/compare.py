"""``GET /api/compare``: 2-6 runs side by side: aligned series, config diff, summary table."""

from __future__ import annotations

import re
from typing import Annotated, Any

from fastapi import APIRouter, Query

from workbench.api.deps import StoreDep, public_run, run_limits
from workbench.api.errors import Invalid, NotFound
from workbench.api.models import MAX_ID, bounded_int
from workbench.api.openapi import comma_separated, errors
from workbench.services.presets import normalized

router = APIRouter(prefix="/api", tags=["compare"])
METRIC_RE = re.compile(
    r"^(?:(trainer|stagehand|activation_stagehand|conductor|strategy)\.)?([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)?)$"
)
DEFAULT_METRICS = "loss,vram_peak_mb,step_time_ms"
_METRIC = METRIC_RE.pattern[1:-1]
METRICS_PATTERN = f"^ *{_METRIC} *(, *{_METRIC} *){{0,19}}$"
"""What the document states of ``metrics``: 1 to 20 names ``METRIC_RE`` takes, separated by
commas (the handler also skips empty names and strips other white space)."""


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, sub in value.items():
            out.update(_flatten(sub, f"{prefix}.{key}" if prefix else str(key)))
        return out
    return {prefix: value}


def live_changes(limits: dict[str, Any]) -> dict[str, list[list[Any]]]:
    """Config path -> ``[[step, new value], ...]`` of the live-limit changes a run applied
    (``limits``: ``workbench.services.limits.effective_limits``)."""
    out: dict[str, list[list[Any]]] = {}
    for change in limits["history"]:
        for field, (_, new) in change["changed"].items():
            out.setdefault(limits["paths"][field], []).append([change["step"], new])
    return out


def config_diff(
    configs: dict[int, dict], live: dict[int, dict[str, list]] | None = None
) -> list[dict[str, Any]]:
    """The dotted paths whose values differ (a path missing in a run counts as None), and
    those a run changed while it ran: ``{path, values, live?: {run_id: [[step, value]...]}}``
    (``live``: run id -> ``live_changes``); ``values`` are the config's."""
    live = live or {}
    flat = {run_id: _flatten(cfg) for run_id, cfg in configs.items()}
    paths = sorted(set().union(*(f.keys() for f in flat.values())))
    diff = []
    for path in paths:
        values = {str(run_id): f.get(path) for run_id, f in flat.items()}
        changes = {str(i): live[i][path] for i in flat if path in live.get(i, {})}
        if len({repr(v) for v in values.values()}) > 1 or changes:
            entry: dict[str, Any] = {"path": path, "values": values}
            if changes:
                entry["live"] = changes
            diff.append(entry)
    return diff


def _ids(ids: str) -> list[int]:
    parts = [part.strip() for part in ids.split(",") if part.strip()]
    out = [bounded_int(part, 1, MAX_ID) for part in parts]
    if None in out:
        bad = parts[out.index(None)]
        raise Invalid(
            f"ids: expected comma-separated run ids from 1 to {MAX_ID}, got {bad[:40]!r}",
            field="ids",
        )
    out = list(dict.fromkeys(out))
    if not 2 <= len(out) <= 6:
        raise Invalid(f"ids: expected 2 to 6 distinct run ids, got {len(out)}", field="ids")
    return out


@router.get("/compare", responses=errors(404))
def compare(
    store: StoreDep,
    ids: Annotated[
        str,
        Query(
            max_length=200,
            description=f"2 to 6 distinct run ids (1 to {MAX_ID}), comma-separated",
            json_schema_extra=comma_separated(
                {"type": "integer", "minimum": 1, "maximum": MAX_ID}, 2, 6
            ),
        ),
    ],
    metrics: Annotated[
        str,
        Query(
            max_length=500,
            description="1 to 20 metrics, comma-separated: a field of step records, "
            "optionally qualified by its source (loss,stagehand.h2d_bytes)",
            json_schema_extra={"pattern": METRICS_PATTERN},
        ),
    ] = DEFAULT_METRICS,
) -> dict:
    """``{runs, missing, series: {metric: {run_id: [[step, value], ...]}}, config_diff: [{path,
    values, live?}], summary: [{run_id, name, status, ...summary}]}``.

    Ids of runs that do not exist (deleted) are listed in ``missing`` and the others compared;
    404 naming ``ids`` when none exists.

    A metric is a field of ``step`` records (``loss``, ``phase_ms.forward``), optionally
    qualified by its source (``stagehand.h2d_bytes``); unqualified, the trainer's record wins
    when several sources carry the field (``vram_peak_mb``).
    """
    found = {run_id: store.get_run(run_id) for run_id in _ids(ids)}
    missing = [run_id for run_id, row in found.items() if row is None]
    rows = {run_id: row for run_id, row in found.items() if row is not None}
    if not rows:
        raise NotFound(f"ids: no run with id {', '.join(map(str, missing))}", field="ids")
    run_ids = list(rows)
    runs = {run_id: public_run(store, row) for run_id, row in rows.items()}
    names = [m.strip() for m in metrics.split(",") if m.strip()]
    if not names or len(names) > 20:
        raise Invalid("metrics: expected 1 to 20 comma-separated field names", field="metrics")
    series: dict[str, dict[str, list]] = {}
    for metric in names:
        match = METRIC_RE.match(metric)
        if not match:
            raise Invalid(f"metrics: {metric!r} is not a field name", field="metrics")
        source, field = match.group(1), match.group(2)
        if source is None:
            sources = store.metric_sources(run_ids, field)
            source = "trainer" if "trainer" in sources or not sources else sources[0]
        series[metric] = {str(i): store.series(i, field, source) for i in run_ids}
    return {
        "runs": list(runs.values()),
        "missing": missing,
        "series": series,
        "config_diff": config_diff(
            {i: normalized(r["config"]) for i, r in runs.items()},
            {i: live_changes(run_limits(store, row)) for i, row in rows.items()},
        ),
        "summary": [
            {"run_id": i, "name": r["name"], "status": r["status"], **r["summary"]}
            for i, r in runs.items()
        ],
    }

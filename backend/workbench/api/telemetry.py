"""``GET /api/runs/{id}/telemetry``: the ingested records, paged by seq, optionally downsampled."""

from __future__ import annotations

import json
from typing import Annotated

from fastapi import APIRouter, Query, Response

from workbench.api.deps import StoreDep, run_row
from workbench.api.errors import Invalid
from workbench.api.models import RunId, Since, TelemetryPage
from workbench.api.openapi import errors
from workbench.services.downsample import PATH_RE, numeric_paths

_PATH = r"[A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*"
FIELDS_PATTERN = rf"^[ \t]*(?:{_PATH})?[ \t]*(?:,[ \t]*(?:{_PATH})?[ \t]*)*$"
"""``fields``: dotted names (``downsample.PATH_RE``) separated by commas, spaces and tabs around
them, empty entries skipped: what the handler reads and checks (naming the entry at fault),
declared in the schema."""

router = APIRouter(prefix="/api/runs", tags=["telemetry"])
MAX_PAGE = 10_000
MAX_BUCKETED = 500_000
"""Records considered for one downsampled answer (a 10k-step run with all sources is ~100k)."""


@router.get("/{run_id}/telemetry", response_model=TelemetryPage, responses=errors(404))
def telemetry(
    store: StoreDep,
    run_id: RunId,
    since: Since = -1,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 1000,
    source: Annotated[str | None, Query(max_length=64)] = None,
    kind: Annotated[str | None, Query(max_length=64)] = None,
    buckets: Annotated[int | None, Query(ge=1, le=10_000)] = None,
    fields: Annotated[
        str | None,
        Query(max_length=2000, json_schema_extra={"pattern": FIELDS_PATTERN}),
    ] = None,
) -> Response:
    """Records with ``seq > since`` in seq order. ``next_since`` is the last seq returned (pass
    it back as ``since`` for the next page); ``count`` is the length of ``data``.

    With ``buckets=N`` every matching record after ``since`` is grouped into N buckets and
    ``data`` holds ``{seq, seq_last, step, step_last, time, count, min, max}`` per bucket:
    the min and max of every numeric field (those present in the first and last 200 matching
    records), so peaks survive; ``fields=a,b.c`` names the fields wanted instead. Over
    ``ROLLUP_MIN_RECORDS`` (20,000) records of one source and kind from the start, buckets are
    merged from the rollups written at ingest (``CHUNK`` = 32 records each; ~30 ms instead of
    ~0.5 s for 100k records): each bucket then holds whole chunks, at most ``n / 32`` of them.

    Pages are written from the stored lines as they are (no parse and re-serialisation).

    Raises:
        Invalid: (422, ``field: "fields"``) a name in ``fields`` that is not a dotted path of
            ``[A-Za-z0-9_]`` parts.
    """
    run_row(store, run_id)
    source, kind = source or None, kind or None
    if buckets:
        if fields:
            paths = [f.strip(" \t") for f in fields.split(",") if f.strip(" \t")]
            bad = [f for f in paths if not PATH_RE.fullmatch(f)]
            if bad:
                raise Invalid(
                    f"fields: found {bad[0]!r}, expected dotted names of [A-Za-z0-9_] parts"
                    " separated by commas (vram_allocated_mb,phase_ms.forward)",
                    field="fields",
                )
        else:
            paths = numeric_paths(store.sample_lines(run_id, since, source, kind))
        data, next_since = store.bucket_stats(
            run_id, since, source, kind, buckets, paths, MAX_BUCKETED
        )
        return _page([json.dumps(b) for b in data], next_since)
    rows = store.telemetry_lines(run_id, since, limit, source, kind)
    return _page([line for _, line in rows], rows[-1][0] if rows else since)


def _page(items: list[str], next_since: int) -> Response:
    """A ``TelemetryPage`` body joined from JSON texts (each record is stored as one line)."""
    body = f'{{"data":[{",".join(items)}],"count":{len(items)},"next_since":{next_since}}}'
    return Response(body, media_type="application/json")

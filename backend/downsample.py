"""Min/max downsampling of telemetry: N buckets, each keeping the extremes of every number.

A peak in ``vram_peak_mb`` or a spike in ``loss`` survives thinning: the bucket that holds it
reports it as its ``max``. Buckets split the records evenly by count, in seq order: record
``i`` of ``n`` goes to bucket ``i * N // n``.

The API computes buckets in SQLite (``Store.bucket_stats``, ~10x faster than Python for 100k
records) over the numeric fields found in the first and last records (``numeric_paths``);
``bucketize`` is the same computation in Python, the reference the tests compare against.
"""

from __future__ import annotations

import json
import re
from typing import Any

ENVELOPE = ("seq", "time", "step")
PATH_RE = re.compile(r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$")
MAX_FIELDS = 64


def _numbers(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in record.items():
        if not prefix and key in ENVELOPE:
            continue
        name = f"{prefix}{key}"
        if isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            out[name] = value
        elif isinstance(value, dict):
            out.update(_numbers(value, name + "."))
    return out


def numeric_paths(lines: list[str]) -> list[str]:
    """Sorted dotted names of the numeric fields in these JSON lines (at most ``MAX_FIELDS``)."""
    found: set[str] = set()
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            found.update(k for k in _numbers(rec) if PATH_RE.match(k))
    return sorted(found)[:MAX_FIELDS]


def bucketize(records: list[dict[str, Any]], buckets: int) -> list[dict[str, Any]]:
    """``records`` (seq order) in ``buckets`` groups: ``{seq, seq_last, step, step_last, time,
    count, min: {field: v}, max: {field: v}}``; ``step``/``step_last`` are the smallest and
    largest step in the bucket, nested numbers are named ``a.b`` (``phase_ms.forward``).
    Fewer records than buckets give one bucket per record."""
    n = len(records)
    if n == 0:
        return []
    buckets = max(1, min(buckets, n))
    groups: list[list[dict[str, Any]]] = [[] for _ in range(buckets)]
    for i, rec in enumerate(records):
        groups[i * buckets // n].append(rec)
    out = []
    for group in groups:
        lo: dict[str, float] = {}
        hi: dict[str, float] = {}
        for rec in group:
            for key, value in _numbers(rec).items():
                if key not in lo or value < lo[key]:
                    lo[key] = value
                if key not in hi or value > hi[key]:
                    hi[key] = value
        steps = [r["step"] for r in group if isinstance(r.get("step"), int)]
        out.append(
            {
                "seq": group[0].get("seq"),
                "seq_last": group[-1].get("seq"),
                "step": min(steps) if steps else None,
                "step_last": max(steps) if steps else None,
                "time": min((r["time"] for r in group if r.get("time") is not None), default=None),
                "count": len(group),
                "min": lo,
                "max": hi,
            }
        )
    return out

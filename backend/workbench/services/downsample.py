"""Min/max downsampling of telemetry: N buckets, each keeping the extremes of every number.

A peak in ``vram_peak_mb`` or a spike in ``loss`` survives thinning: the bucket that holds it
reports it as its ``max``. Buckets split the records evenly by count, in seq order: record
``i`` of ``n`` goes to bucket ``i * N // n``.

The API computes buckets in SQLite (``Store.bucket_stats``, ~10x faster than Python for 100k
records) over the numeric fields found in the first and last records (``numeric_paths``);
``bucketize`` is the same computation in Python, the reference the tests compare against.

Rollups make a long run's buckets cheap: at ingest every ``CHUNK`` consecutive records of one
``(run, source, kind)`` are folded into one ``Chunk`` (min and max of every number, first and
last seq, count), stored beside the records. Past ``ROLLUP_MIN_RECORDS`` matching records the
API merges chunks instead of parsing every record (100k block records: ~0.5 s -> ~30 ms); a
bucket is then a run of whole chunks, so it holds a multiple of ``CHUNK`` records and there are
at most ``n / CHUNK`` of them. The extremes are the same: the max of chunk maxima is the max.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

ENVELOPE = ("seq", "time", "step")
PATH_RE = re.compile(r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$")
MAX_FIELDS = 64
CHUNK = 32
"""Records of one (run, source, kind) folded into one rollup row."""
ROLLUP_MIN_RECORDS = 20_000
"""Matching records from which buckets are merged from rollups instead of computed exactly."""


def numbers(record: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """The record's numeric fields by dotted name (``phase_ms.forward``), envelope and bools left
    out. (``type() is`` rather than ``isinstance``: it runs for every ingested record, and a
    bool is not a number here.)"""
    out: dict[str, float] = {}
    for key, value in record.items():
        kind = type(value)
        if kind is float or kind is int:
            if prefix or key not in ENVELOPE:
                out[prefix + key] = value
        elif kind is dict:
            out.update(numbers(value, f"{prefix}{key}."))
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
            found.update(k for k in numbers(rec) if PATH_RE.match(k))
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
            values = numbers(rec)
            _widen(lo, hi, values, values)
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


def _widen(lo: dict[str, float], hi: dict[str, float], lows: dict, highs: dict) -> None:
    """Lowers ``lo`` to ``lows`` and raises ``hi`` to ``highs``, field by field."""
    for key, value in lows.items():
        if key not in lo or value < lo[key]:
            lo[key] = value
    for key, value in highs.items():
        if key not in hi or value > hi[key]:
            hi[key] = value


@dataclass
class Chunk:
    """Up to ``CHUNK`` consecutive records of one (run, source, kind), folded (see the module)."""

    index: int
    seq_first: int
    seq_last: int
    step_min: int | None = None
    step_max: int | None = None
    time_min: float | None = None
    count: int = 0
    lo: dict[str, float] = field(default_factory=dict)
    hi: dict[str, float] = field(default_factory=dict)

    def add(self, record: dict[str, Any]) -> None:
        seq = record["seq"]
        if seq < self.seq_first:
            self.seq_first = seq
        if seq > self.seq_last:
            self.seq_last = seq
        step = record.get("step")
        if type(step) is int:
            if self.step_min is None or step < self.step_min:
                self.step_min = step
            if self.step_max is None or step > self.step_max:
                self.step_max = step
        t = record.get("time")
        if (type(t) is float or type(t) is int) and (self.time_min is None or t < self.time_min):
            self.time_min = t
        self.count += 1
        values = numbers(record)
        _widen(self.lo, self.hi, values, values)


def fold(last: Chunk | None, records: list[dict[str, Any]]) -> list[Chunk]:
    """``records`` (seq order, one source and kind) added after ``last``, the newest stored chunk.

    Returns the chunks to write: ``last`` itself when it had room, then new ones; only the final
    one may hold fewer than ``CHUNK`` records.
    """
    out: list[Chunk] = []
    current = last if last is not None and last.count < CHUNK else None
    next_index = 0 if last is None else last.index + 1
    for rec in records:
        if current is None or current.count >= CHUNK:
            current = Chunk(next_index, rec["seq"], rec["seq"])
            next_index += 1
        if not out or out[-1] is not current:
            out.append(current)
        current.add(rec)
    return out


def merge_chunks(chunks: list[Chunk], buckets: int, paths: list[str]) -> list[dict[str, Any]]:
    """Chunks (in order) as at most ``buckets`` buckets, shaped as ``bucketize``'s, with the
    extremes of ``paths`` only. Chunk ``i`` of ``n`` goes to bucket ``i * buckets // n``."""
    n = len(chunks)
    if n == 0:
        return []
    buckets = max(1, min(buckets, n))
    wanted = set(paths)
    out: list[dict[str, Any]] = []
    for i, c in enumerate(chunks):
        b = i * buckets // n
        if len(out) <= b:
            out.append(
                {
                    "seq": c.seq_first,
                    "seq_last": c.seq_last,
                    "step": c.step_min,
                    "step_last": c.step_max,
                    "time": c.time_min,
                    "count": 0,
                    "min": {},
                    "max": {},
                }
            )
        cur = out[-1]
        cur["seq_last"] = c.seq_last
        if c.step_min is not None:
            cur["step"] = c.step_min if cur["step"] is None else min(cur["step"], c.step_min)
            cur["step_last"] = (
                c.step_max if cur["step_last"] is None else max(cur["step_last"], c.step_max)
            )
        if c.time_min is not None:
            cur["time"] = c.time_min if cur["time"] is None else min(cur["time"], c.time_min)
        cur["count"] += c.count
        _widen(
            cur["min"],
            cur["max"],
            {k: v for k, v in c.lo.items() if k in wanted},
            {k: v for k, v in c.hi.items() if k in wanted},
        )
    return out

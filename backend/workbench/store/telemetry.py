"""Telemetry in the database: ingest the workers' JSONL lines, page them, bucket them for the
charts (min/max rollups), and derive a run's summary from them.

Rows keep the worker's JSONL line verbatim in ``data`` (the API and websocket return exactly
what the worker wrote) and copy the envelope into columns for indexed queries; the key
``(run_id, seq)`` makes re-ingesting a line after a restart a no-op.
"""

from __future__ import annotations

import json
import time
from typing import Any

import sqlite_utils

from stagehand.config.records import SQUAREQ_STEP
from workbench.contract.records import OOM_RECOVERY, RESUMED, RUN_FINISHED, RUN_STARTED
from workbench.services.downsample import ROLLUP_MIN_RECORDS, Chunk, fold, merge_chunks


def _write_chunks(db, run_id: int, source: str, kind: str, chunks: list[Chunk]) -> None:
    db.conn.executemany(
        "INSERT OR REPLACE INTO telemetry_rollup (run_id, source, kind, chunk, seq_first,"
        " seq_last, step_min, step_max, time_min, count, lo, hi)"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        [
            (run_id, source, kind, c.index, c.seq_first, c.seq_last, c.step_min, c.step_max)
            + (c.time_min, c.count, json.dumps(c.lo), json.dumps(c.hi))
            for c in chunks
        ],
    )


def _chunk(row: tuple) -> Chunk:
    """A ``telemetry_rollup`` row from ``chunk`` on (see ``ROLLUP_COLUMNS``)."""
    return Chunk(*row[:7], json.loads(row[7]), json.loads(row[8]))


ROLLUP_COLUMNS = "chunk, seq_first, seq_last, step_min, step_max, time_min, count, lo, hi"


class TelemetryTables:
    """The telemetry queries of ``Store`` (``self.db``: this thread's connection)."""

    db: sqlite_utils.Database

    def max_in_steps(self, run_id: int, path: str, source: str = "trainer") -> float | None:
        """The largest ``path`` (a JSON path below the record) of the run's step records of
        ``source``, sampling steps left out."""
        (value,) = self.db.execute(
            "SELECT MAX(json_extract(data, ?)) FROM telemetry WHERE run_id = ? AND source = ?"
            " AND kind = 'step' AND json_extract(data, '$.sampling') IS NULL"
            " AND json_extract(data, '$.aborted') IS NULL",
            ["$." + path, run_id, source],
        ).fetchone()
        return value

    def step_record(self, run_id: int, source: str, step: int) -> dict | None:
        """The newest ``source``/``step`` record of training step ``step`` (parsed), sampling
        steps left out; None when there is none."""
        row = self.db.execute(
            "SELECT data FROM telemetry WHERE run_id = ? AND source = ? AND kind = 'step'"
            " AND step = ? AND json_extract(data, '$.sampling') IS NULL"
            " AND json_extract(data, '$.aborted') IS NULL ORDER BY seq DESC LIMIT 1",
            [run_id, source, step],
        ).fetchone()
        return json.loads(row[0]) if row else None

    def mean_step_ms_after(self, run_id: int, step: int) -> float | None:
        """Mean ``step_time_ms`` of the trainer's step records after ``step`` (1: past the
        trace step), sampling steps left out."""
        (value,) = self.db.execute(
            "SELECT AVG(json_extract(data, '$.step_time_ms')) FROM telemetry WHERE run_id = ?"
            " AND source = 'trainer' AND kind = 'step' AND step > ?"
            " AND json_extract(data, '$.sampling') IS NULL"
            " AND json_extract(data, '$.aborted') IS NULL",
            [run_id, step],
        ).fetchone()
        return value

    def step_block_curve(self, run_id: int, step: int) -> list[tuple[float, float, str]]:
        """``(time s, vram_allocated_mb, event)`` of the weight runtime's block records of
        ``step``, in seq order."""
        rows = self.db.execute(
            "SELECT time, json_extract(data, '$.vram_allocated_mb'), json_extract(data,"
            " '$.event') FROM telemetry INDEXED BY idx_telemetry_run_id_source_kind_seq WHERE"
            " run_id = ? AND source = 'stagehand' AND kind = 'block' AND step = ? ORDER BY seq",
            [run_id, step],
        )
        return [(t, v, e) for t, v, e in rows if v is not None]

    # -- telemetry -----------------------------------------------------------------------
    def ingest(
        self, run_id: int, rows: list[tuple], offset: int, records: list[dict] | None = None
    ) -> int:
        """Insert parsed lines and advance the run's tail offset in one transaction.

        ``rows`` are ``(seq, time, source, kind, step, phase, line)`` in seq order; ``offset``
        is the byte offset just past the last complete line. Returns how many rows were new (a
        line seen before a restart is ignored by its ``(run_id, seq)`` key). New rows with a
        source and a kind are folded into the rollups in the same transaction; ``records`` are
        the lines already parsed, when the caller has them (the tailer does).
        """
        db = self.db
        with db.conn:
            db.execute("BEGIN IMMEDIATE")
            seqs = [r[0] for r in rows]
            seen = set()
            if seqs:
                seen = {
                    s
                    for (s,) in db.execute(
                        "SELECT seq FROM telemetry WHERE run_id = ? AND seq BETWEEN ? AND ?",
                        [run_id, min(seqs), max(seqs)],
                    )
                }
            # New rows only (stored before, or twice in this batch): each is rolled up once.
            fresh, fresh_records = [], []
            for i, row in enumerate(rows):
                if row[0] not in seen:
                    seen.add(row[0])
                    fresh.append(row)
                    fresh_records.append(json.loads(row[6]) if records is None else records[i])
            before = db.conn.total_changes
            db.conn.executemany(
                "INSERT OR IGNORE INTO telemetry (run_id, seq, time, source, kind, step, phase,"
                " data) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [(run_id, *r) for r in fresh],
            )
            new = db.conn.total_changes - before
            self._roll_up(run_id, fresh, fresh_records)
            last_seq = max((r[0] for r in rows), default=-1)
            db.execute(
                "UPDATE runs SET tail_offset = ?, last_seq = MAX(last_seq, ?),"
                " last_record_at = ? WHERE id = ?",
                [offset, last_seq, time.time(), run_id],
            )
        return new

    def _roll_up(self, run_id: int, rows: list[tuple], records: list[dict]) -> None:
        """Folds new telemetry rows into their (source, kind)'s newest chunk and new ones."""
        by_key: dict[tuple[str, str], list[dict]] = {}
        for (seq, _t, source, kind, *_), rec in zip(rows, records, strict=True):
            if source is not None and kind is not None:
                if type(rec.get("seq")) is not int:  # a foreign writer's "7" (the row has 7)
                    rec = {**rec, "seq": seq}
                by_key.setdefault((source, kind), []).append(rec)
        for (source, kind), records in by_key.items():
            row = self.db.execute(
                f"SELECT {ROLLUP_COLUMNS} FROM telemetry_rollup WHERE run_id = ? AND source = ?"
                " AND kind = ? ORDER BY chunk DESC LIMIT 1",
                [run_id, source, kind],
            ).fetchone()
            last = _chunk(row) if row else None
            _write_chunks(self.db, run_id, source, kind, fold(last, records))

    def telemetry_lines(
        self,
        run_id: int,
        since: int = -1,
        limit: int = 1000,
        source: str | None = None,
        kind: str | None = None,
    ) -> list[tuple[int, str]]:
        """``(seq, line)`` of records with ``seq > since``, in seq order, at most ``limit``."""
        table, where, args = self._filter(run_id, since, source, kind)
        sql = f"SELECT seq, data FROM {table} WHERE {where} ORDER BY seq LIMIT ?"
        return [(int(s), d) for s, d in self.db.execute(sql, [*args, limit])]

    def _filter(
        self, run_id: int, since: int, source: str | None, kind: str | None
    ) -> tuple[str, str, list[Any]]:
        """``(FROM table, WHERE clause, args)`` for the records of ``run_id`` after ``since``.

        For ``ORDER BY seq`` SQLite's planner prefers the primary key ``(run_id, seq)`` and then
        reads every record of the run, ``ANALYZE`` or not; with a source or kind filter the
        matching index is named instead (a 100k-record run: ~30 ms a page -> under 10 ms).
        """
        where, args = ["run_id = ?", "seq > ?"], [run_id, since]
        table = "telemetry"
        if source:
            where.append("source = ?")
            args.append(source)
            table = "telemetry INDEXED BY idx_telemetry_run_id_source_kind_seq"
        if kind:
            where.append("kind = ?")
            args.append(kind)
            if not source:
                table = "telemetry INDEXED BY idx_telemetry_run_id_kind_seq"
        return table, " AND ".join(where), args

    def sample_lines(
        self, run_id: int, since: int, source: str | None, kind: str | None, n: int = 200
    ) -> list[str]:
        """The first and last ``n`` matching lines (to learn which fields the records carry)."""
        table, where, args = self._filter(run_id, since, source, kind)
        out = []
        for order in ("ASC", "DESC"):
            sql = f"SELECT data FROM {table} WHERE {where} ORDER BY seq {order} LIMIT ?"
            out += [d for (d,) in self.db.execute(sql, [*args, n])]
        return out

    def bucket_stats(
        self,
        run_id: int,
        since: int,
        source: str | None,
        kind: str | None,
        buckets: int,
        paths: list[str],
        max_records: int,
    ) -> tuple[list[dict[str, Any]], int]:
        """Min and max of each JSON ``paths`` entry per bucket, computed in SQLite.

        Record ``i`` (0-based, seq order) of ``n`` goes to bucket ``i * buckets // n``. Returns
        ``([{bucket, seq, seq_last, step, step_last, time, count, min: {}, max: {}}], last_seq)``.
        ``paths`` must be dotted names of ``[A-Za-z0-9_]`` parts (checked by the caller). Over
        ``ROLLUP_MIN_RECORDS`` records of one source and kind from the start (``since < 0``),
        the buckets are merged from the rollups instead (``workbench.services.downsample``).
        """
        table, where, args = self._filter(run_id, since, source, kind)
        # Count first (an index-only read) so that the bucket of a row is known from its row
        # number alone, and extract each path once per row: JSON parsing is the cost here.
        (n,) = self.db.execute(
            f"SELECT MIN(COUNT(*), ?) FROM {table} WHERE {where}", [max_records, *args]
        ).fetchone()
        if not n:
            return [], since
        if since < 0 and source and kind and n > ROLLUP_MIN_RECORDS:
            out = merge_chunks(self._rollups(run_id, source, kind, n), buckets, paths)
            return out, out[-1]["seq_last"] if out else since
        values = "".join(f", json_extract(data, '$.{p}') AS v{i}" for i, p in enumerate(paths))
        extra = "".join(f", MIN(v{i}), MAX(v{i})" for i in range(len(paths)))
        sql = (
            "WITH m AS (SELECT seq, step, time, ROW_NUMBER() OVER (ORDER BY seq) - 1 AS rn"
            f"{values} FROM {table} WHERE {where} ORDER BY seq LIMIT ?)"
            " SELECT rn * ? / ? AS b, MIN(seq), MAX(seq), MIN(step), MAX(step), MIN(time),"
            f" COUNT(*){extra} FROM m GROUP BY b ORDER BY b"
        )
        out, last = [], since
        for row in self.db.execute(sql, [*args, max_records, buckets, n]):
            lo = {p: row[7 + 2 * i] for i, p in enumerate(paths) if row[7 + 2 * i] is not None}
            hi = {p: row[8 + 2 * i] for i, p in enumerate(paths) if row[8 + 2 * i] is not None}
            out.append(
                {
                    "seq": row[1],
                    "seq_last": row[2],
                    "step": row[3],
                    "step_last": row[4],
                    "time": row[5],
                    "count": row[6],
                    "min": lo,
                    "max": hi,
                }
            )
            last = row[2]
        return out, last

    def _rollups(self, run_id: int, source: str, kind: str, n: int) -> list[Chunk]:
        """The chunks of (run, source, kind), in order. When they hold fewer than the ``n``
        records counted (a run stored before rollups existed) they are first rebuilt from the
        records, in one transaction; more (records ingested since ``n`` was read) is fine."""
        key = [run_id, source, kind]
        where = "run_id = ? AND source = ? AND kind = ?"
        rows = self.db.execute(
            f"SELECT {ROLLUP_COLUMNS} FROM telemetry_rollup WHERE {where} ORDER BY chunk", key
        ).fetchall()
        chunks = [_chunk(r) for r in rows]
        if sum(c.count for c in chunks) >= n:
            return chunks
        db = self.db
        with db.conn:
            db.execute("BEGIN IMMEDIATE")
            db.execute(f"DELETE FROM telemetry_rollup WHERE {where}", key)
            lines = db.execute(f"SELECT seq, data FROM telemetry WHERE {where} ORDER BY seq", key)
            chunks = fold(None, [{**json.loads(d), "seq": s} for s, d in lines])
            _write_chunks(db, run_id, source, kind, chunks)
        return chunks

    def last_record(self, run_id: int, source: str | None = None, kind: str | None = None):
        """The newest record (parsed) matching ``source``/``kind``, or None."""
        table, where, args = self._filter(run_id, -1, source, kind)
        row = self.db.execute(
            f"SELECT data FROM {table} WHERE {where} ORDER BY seq DESC LIMIT 1", args
        ).fetchone()
        return json.loads(row[0]) if row else None

    def step_times_ms(self, run_id: int, last: int = 50) -> list[float]:
        rows = self.db.execute(
            "SELECT json_extract(data, '$.step_time_ms') FROM telemetry WHERE run_id = ? AND "
            "source = 'trainer' AND kind = 'step' ORDER BY seq DESC LIMIT ?",
            [run_id, last],
        )
        return [float(v) for (v,) in rows if v is not None]

    def series(self, run_id: int, metric: str, source: str | None) -> list[list[float]]:
        """``[[step, value], ...]`` of ``metric`` (a JSON path below the record) over step records,
        a sampling step's left out (``sampling: true``: its number is also a training step's), an
        attempt that ran out of memory (``aborted: true``: its rerun has the step's figures), and
        so are a discarded run's: a record followed by a ``trainer/resumed`` record at a lower
        step (the resumed worker trained that step again: the later record is the one kept)."""
        path = "$." + metric
        where = (
            "run_id = ? AND kind = 'step' AND json_extract(data, ?) IS NOT NULL"
            " AND json_extract(data, '$.sampling') IS NULL"
            " AND json_extract(data, '$.aborted') IS NULL"
        )
        args: list[Any] = [run_id, path]
        if source:
            where += " AND source = ?"
            args.append(source)
        rows = self.db.execute(
            f"SELECT seq, step, json_extract(data, ?) FROM telemetry WHERE {where} ORDER BY seq",
            [path, *args],
        )
        resumes = self.db.execute(
            "SELECT seq, step FROM telemetry WHERE run_id = ? AND source = ? AND kind = ?"
            " AND step IS NOT NULL",
            [run_id, *RESUMED],
        ).fetchall()
        return [
            [s, v]
            for seq, s, v in rows
            if isinstance(v, (int, float))
            and not (s is not None and any(r > seq and at < s for r, at in resumes))
        ]

    def metric_sources(self, run_ids: list[int], metric: str) -> list[str]:
        marks = ",".join("?" for _ in run_ids)
        rows = self.db.execute(
            f"SELECT DISTINCT source FROM telemetry WHERE run_id IN ({marks}) AND kind = 'step'"
            " AND json_extract(data, ?) IS NOT NULL",
            [*run_ids, "$." + metric],
        )
        return [s for (s,) in rows]

    def summary(self, run_id: int) -> dict[str, Any]:
        """Summary figures from the ingested telemetry (see ``RunSummary``)."""
        q = self.db.execute
        steps, mean_ms = q(
            "SELECT MAX(step), AVG(json_extract(data, '$.step_time_ms')) FROM telemetry "
            "WHERE run_id = ? AND source = 'trainer' AND kind = 'step'",
            [run_id],
        ).fetchone()
        final = q(
            "SELECT json_extract(data, '$.loss') FROM telemetry WHERE run_id = ? AND "
            "source = 'trainer' AND kind = 'step' ORDER BY seq DESC LIMIT 1",
            [run_id],
        ).fetchone()
        # Peak VRAM per stage: stage 1 (encoding, caching) runs from the trainer's first
        # "cache" stage record to its first "train" one; every other step record is training's.
        first = (
            "SELECT MIN(seq) FROM telemetry WHERE run_id = ? AND source = 'trainer' AND "
            "kind = 'stage' AND json_extract(data, '$.stage') = ?"
        )
        (cache_seq,) = q(first, [run_id, "cache"]).fetchone()
        (train_seq,) = q(first, [run_id, "train"]).fetchone()
        start, end = (-1, -1) if cache_seq is None else (cache_seq, train_seq or 2**62)
        (encode_peak, peak) = q(
            "SELECT MAX(CASE WHEN seq > ? AND seq < ? THEN v END), "
            "MAX(CASE WHEN seq > ? AND seq < ? THEN NULL ELSE v END) FROM "
            "(SELECT seq, json_extract(data, '$.vram_peak_mb') AS v FROM telemetry "
            "WHERE run_id = ? AND kind = 'step')",
            [start, end, start, end, run_id],
        ).fetchone()
        (spill,) = q(
            "SELECT SUM(json_extract(data, '$.spill_bytes')) FROM telemetry WHERE run_id = ? "
            "AND source = 'activation_stagehand' AND kind = 'step'",
            [run_id],
        ).fetchone()
        (stall,) = q(
            "SELECT SUM(json_extract(data, '$.stall_time_ms')) FROM telemetry WHERE run_id = ? "
            "AND source IN ('stagehand', 'activation_stagehand') AND kind = 'step'",
            [run_id],
        ).fetchone()
        (recoveries,) = q(
            "SELECT COUNT(*) FROM telemetry WHERE run_id = ? AND source = ? AND kind = ?",
            [run_id, *OOM_RECOVERY],
        ).fetchone()
        started = self.last_record(run_id, *RUN_STARTED) or {}
        finished = self.last_record(run_id, *RUN_FINISHED) or {}
        # The training stage's weight-streaming mode: the last one recorded (stage 1's text
        # encoders stream before it).
        weights = self.last_record(run_id, "stagehand", "step") or {}
        squareq = self.last_record(run_id, *SQUAREQ_STEP) or {}
        return {
            "steps_done": finished.get("steps_done", steps),
            "max_steps": started.get("max_steps"),
            "final_loss": final[0] if final else None,
            "peak_vram_mb": peak,
            "encode_peak_vram_mb": encode_peak,
            "mean_step_time_ms": mean_ms,
            "spill_bytes": int(spill) if spill is not None else None,
            "stall_ms": stall,
            "weights_mode": weights.get("weights_mode"),
            "weights_mode_reason": weights.get("weights_mode_reason"),
            "weights_squareq": squareq.get("note"),
            "recoveries": recoveries,
        }

    def oom_recoveries(self) -> list[tuple[int, dict]]:
        """``(run_id, record)`` of every ``trainer/oom_recovery`` record (parsed) of every run,
        newest run first, in seq order within a run: what later plans learn from
        (``workbench.services.calibration.recovery_for``). One index probe per run."""
        rows = self.db.execute(
            "SELECT r.id, t.data FROM runs r JOIN telemetry t INDEXED BY"
            " idx_telemetry_run_id_source_kind_seq ON t.run_id = r.id AND t.source = ?"
            " AND t.kind = ? ORDER BY r.id DESC, t.seq",
            list(OOM_RECOVERY),
        )
        return [(run_id, json.loads(data)) for run_id, data in rows]

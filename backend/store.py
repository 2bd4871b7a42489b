"""All SQL of the backend: presets, runs, tags and ingested telemetry in one SQLite file.

WAL mode so the ingester writes while the API reads. A ``sqlite_utils.Database`` cannot cross
threads, so ``Store`` opens one connection per thread (``threading.local``) on the same file.
Schema changes are named migrations applied once each, in order, recorded in ``_migrations``.

Telemetry rows keep the worker's JSONL line verbatim in ``data`` (the API and websocket return
exactly what the worker wrote) and copy the envelope into columns for indexed queries; the key
``(run_id, seq)`` makes re-ingesting a line after a restart a no-op.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import sqlite_utils

from backend.downsample import ROLLUP_MIN_RECORDS, Chunk, fold, merge_chunks
from runtime.status import check_status_transition

# Run statuses and their legal moves: runtime/status.py (shared with the worker and the API).


def _m001_initial(db: sqlite_utils.Database) -> None:
    db["presets"].create(
        {
            "name": str,
            "config": str,
            "description": str,
            "builtin": int,
            "created_at": float,
            "updated_at": float,
        },
        pk="name",
    )
    db["runs"].create(
        {
            "id": int,
            "name": str,
            "preset": str,
            "config": str,
            "status": str,
            "device": str,
            "created_at": float,
            "started_at": float,
            "finished_at": float,
            "pid": int,
            "pid_create_time": float,
            "exit_code": int,
            "signal": str,
            "error": str,
            "notes": str,
            "summary": str,
            "cancel_requested_at": float,
            "tail_offset": int,
            "last_seq": int,
            "last_record_at": float,
            "control_seq": int,
        },
        pk="id",
        not_null={"name", "preset", "config", "status"},
        defaults={"notes": "", "tail_offset": 0, "last_seq": -1, "control_seq": 0},
    )
    db["runs"].create_index(["status"])
    db["run_tags"].create(
        {"run_id": int, "tag": str}, pk=("run_id", "tag"), foreign_keys=[("run_id", "runs", "id")]
    )
    db["telemetry"].create(
        {
            "run_id": int,
            "seq": int,
            "time": float,
            "source": str,
            "kind": str,
            "step": int,
            "phase": str,
            "data": str,
        },
        pk=("run_id", "seq"),
    )
    db["telemetry"].create_index(["run_id", "source", "kind", "seq"])


def _m002_telemetry_kind_index(db: sqlite_utils.Database) -> None:
    # Summary figures read every source's ``step`` records (peak VRAM): an index on kind keeps
    # that from scanning a run's block events.
    db["telemetry"].create_index(["run_id", "kind", "seq"])


def _m003_telemetry_rollup(db: sqlite_utils.Database) -> None:
    # Min/max rollups (backend.downsample.Chunk), filled at ingest. Runs stored before this
    # migration get theirs on their first bucketed read (Store._rollups), not at start-up
    # (~2 s per 100k records).
    db.execute(
        "CREATE TABLE telemetry_rollup (run_id INTEGER NOT NULL, source TEXT NOT NULL,"
        " kind TEXT NOT NULL, chunk INTEGER NOT NULL, seq_first INTEGER, seq_last INTEGER,"
        " step_min INTEGER, step_max INTEGER, time_min REAL, count INTEGER, lo TEXT, hi TEXT,"
        " PRIMARY KEY (run_id, source, kind, chunk))"
    )


def _m004_run_executor(db: sqlite_utils.Database) -> None:
    # Which executor started a run (``local`` | ``ray``), its job there (a pid, a Ray
    # submission id) and the node it runs on: what ``reconcile`` needs to find it again.
    for column in ("executor", "job_id", "node"):
        db.execute(f"ALTER TABLE runs ADD COLUMN {column} TEXT")


def _m005_run_resume(db: sqlite_utils.Database) -> None:
    # A stopped run re-queued to continue from its last checkpoint: its worker gets --resume.
    db.execute("ALTER TABLE runs ADD COLUMN resume INTEGER NOT NULL DEFAULT 0")


def _m006_run_ids(db: sqlite_utils.Database) -> None:
    # The highest run id ever given: a deleted run's id (and its folder's name) is never given
    # again, so a link or a downloaded file naming it cannot come to mean another run.
    db.execute("CREATE TABLE run_ids (last INTEGER NOT NULL)")
    db.execute("INSERT INTO run_ids SELECT IFNULL(MAX(id), 0) FROM runs")


def _m007_calibrations(db: sqlite_utils.Database) -> None:
    # A finished run's measured figures next to its plan's (runtime/plan/feedback.py), kept
    # under the device profile and family that later plans look them up by.
    db.execute(
        "CREATE TABLE calibrations (run_id INTEGER PRIMARY KEY, device TEXT NOT NULL,"
        " family TEXT NOT NULL, created_at REAL NOT NULL, predicted TEXT NOT NULL,"
        " measured TEXT NOT NULL, ratios TEXT NOT NULL, plan TEXT NOT NULL)"
    )
    db.execute("CREATE INDEX idx_calibrations_key ON calibrations (device, family, created_at)")


def _m008_tunes(db: sqlite_utils.Database) -> None:
    # One tune = one group of trial runs (runs.group_id), with the candidates its plan proposed.
    db.execute(
        "CREATE TABLE tunes (id INTEGER PRIMARY KEY, preset TEXT NOT NULL, budget_mb REAL NOT"
        " NULL, device TEXT NOT NULL, trial_steps INTEGER NOT NULL, created_at REAL NOT NULL,"
        " candidates TEXT NOT NULL)"
    )
    db.execute("ALTER TABLE runs ADD COLUMN group_id INTEGER")
    db.execute("CREATE INDEX idx_runs_group_id ON runs (group_id)")


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

MIGRATIONS: list[tuple[str, Callable[[sqlite_utils.Database], None]]] = [
    ("001_initial", _m001_initial),
    ("002_telemetry_kind_index", _m002_telemetry_kind_index),
    ("003_telemetry_rollup", _m003_telemetry_rollup),
    ("004_run_executor", _m004_run_executor),
    ("005_run_resume", _m005_run_resume),
    ("006_run_ids", _m006_run_ids),
    ("007_calibrations", _m007_calibrations),
    ("008_tunes", _m008_tunes),
]
"""Append new ``(name, function)`` pairs; never edit or reorder applied ones."""


class Store:
    """The workbench database at ``path``. Safe to share between threads."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._all_lock = threading.Lock()
        self.migrate()

    # -- connections ---------------------------------------------------------------------
    @property
    def db(self) -> sqlite_utils.Database:
        db = getattr(self._local, "db", None)
        if db is None:
            conn = sqlite3.connect(self.path, timeout=30.0, isolation_level=None)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
            conn.execute("PRAGMA foreign_keys=ON")
            db = sqlite_utils.Database(conn)
            self._local.db = db
            with self._all_lock:
                self._all.append(conn)
        return db

    def close(self) -> None:
        with self._all_lock:
            for conn in self._all:
                try:
                    conn.close()
                except sqlite3.ProgrammingError:
                    pass  # opened on a thread that is gone; sqlite frees it with the thread
            self._all.clear()
        self._local = threading.local()

    def migrate(self) -> list[str]:
        """Apply the migrations not yet recorded; returns their names."""
        db = self.db
        db["_migrations"].create({"name": str, "applied_at": float}, pk="name", if_not_exists=True)
        done = {row["name"] for row in db["_migrations"].rows}
        applied = []
        for name, fn in MIGRATIONS:
            if name in done:
                continue
            with db.conn:
                db.execute("BEGIN IMMEDIATE")
                fn(db)
                db["_migrations"].insert({"name": name, "applied_at": time.time()})
            applied.append(name)
        return applied

    # -- presets -------------------------------------------------------------------------
    def upsert_builtin_preset(self, name: str, config: dict, description: str) -> None:
        now = time.time()
        self.db["presets"].upsert(
            {
                "name": name,
                "config": json.dumps(config),
                "description": description,
                "builtin": 1,
                "created_at": now,
                "updated_at": now,
            },
            pk="name",
        )

    def drop_builtins_except(self, names: Iterable[str]) -> None:
        keep = list(names)
        marks = ",".join("?" for _ in keep) or "''"
        self.db.execute(f"DELETE FROM presets WHERE builtin = 1 AND name NOT IN ({marks})", keep)

    def list_presets(self) -> list[dict]:
        rows = self.db.execute_returning_dicts("SELECT * FROM presets ORDER BY builtin DESC, name")
        return [_preset(r) for r in rows]

    def get_preset(self, name: str) -> dict | None:
        rows = self.db.execute_returning_dicts("SELECT * FROM presets WHERE name = ?", [name])
        return _preset(rows[0]) if rows else None

    def insert_preset(self, name: str, config: dict, description: str = "") -> None:
        """Raises ``sqlite3.IntegrityError`` when the name is taken."""
        now = time.time()
        self.db.execute(
            "INSERT INTO presets (name, config, description, builtin, created_at, updated_at) "
            "VALUES (?, ?, ?, 0, ?, ?)",
            [name, json.dumps(config), description, now, now],
        )

    def update_preset(self, name: str, config: dict, description: str) -> None:
        self.db.execute(
            "UPDATE presets SET config = ?, description = ?, updated_at = ? "
            "WHERE name = ? AND builtin = 0",
            [json.dumps(config), description, time.time(), name],
        )

    def delete_preset(self, name: str) -> None:
        self.db.execute("DELETE FROM presets WHERE name = ? AND builtin = 0", [name])

    # -- runs ----------------------------------------------------------------------------
    def create_run(
        self, name: str, preset: str, config: dict, device: str, group_id: int | None = None
    ) -> int:
        """A new queued run; its id is above every id ever given (deleted runs' too).
        ``group_id``: the tune it is a trial of."""
        db = self.db
        with db.conn:
            db.execute("BEGIN IMMEDIATE")
            db.execute(
                "UPDATE run_ids SET last = MAX(last, (SELECT IFNULL(MAX(id), 0) FROM runs)) + 1"
            )
            (run_id,) = db.execute("SELECT last FROM run_ids").fetchone()
            db.execute(
                "INSERT INTO runs (id, name, preset, config, status, device, created_at,"
                " group_id) VALUES (?, ?, ?, ?, 'queued', ?, ?, ?)",
                [run_id, name, preset, json.dumps(config), device, time.time(), group_id],
            )
        return int(run_id)

    def get_run(self, run_id: int) -> dict | None:
        rows = self.db.execute_returning_dicts("SELECT * FROM runs WHERE id = ?", [run_id])
        return self._with_tags(rows)[0] if rows else None

    def list_runs(
        self,
        status: str | None = None,
        preset: str | None = None,
        tag: str | None = None,
        group_id: int | None = None,
    ) -> list[dict]:
        where, args = [], []
        if group_id is not None:
            where.append("group_id = ?")
            args.append(group_id)
        if status:
            where.append("status = ?")
            args.append(status)
        if preset:
            where.append("preset = ?")
            args.append(preset)
        if tag:
            where.append("id IN (SELECT run_id FROM run_tags WHERE tag = ?)")
            args.append(tag)
        sql = "SELECT * FROM runs" + (" WHERE " + " AND ".join(where) if where else "")
        return self._with_tags(self.db.execute_returning_dicts(sql + " ORDER BY id DESC", args))

    def runs_with_status(self, *statuses: str) -> list[dict]:
        marks = ",".join("?" for _ in statuses)
        sql = f"SELECT * FROM runs WHERE status IN ({marks}) ORDER BY id"
        return self._with_tags(self.db.execute_returning_dicts(sql, list(statuses)))

    def update_run(self, run_id: int, **fields: Any) -> None:
        if not fields:
            return
        for key in ("error", "summary"):
            if key in fields and fields[key] is not None and not isinstance(fields[key], str):
                fields[key] = json.dumps(fields[key])
        sets = ", ".join(f"{k} = ?" for k in fields)
        self.db.execute(f"UPDATE runs SET {sets} WHERE id = ?", [*fields.values(), run_id])

    def set_status_if(self, run_id: int, expected: Iterable[str], **fields: Any) -> bool:
        """Update only while the run's status is one of ``expected``; True if it changed.

        Raises:
            runtime.status.RunStatusError: ``fields["status"]`` is not a legal next status of
                every status in ``expected`` (``runtime.status.LEGAL_NEXT``), before anything
                is written.
        """
        exp = list(expected)
        if "status" in fields:
            for old in exp:
                check_status_transition(old, fields["status"])
        for key in ("error", "summary"):
            if key in fields and fields[key] is not None and not isinstance(fields[key], str):
                fields[key] = json.dumps(fields[key])
        sets = ", ".join(f"{k} = ?" for k in fields)
        marks = ",".join("?" for _ in exp)
        cur = self.db.execute(
            f"UPDATE runs SET {sets} WHERE id = ? AND status IN ({marks})",
            [*fields.values(), run_id, *exp],
        )
        return cur.rowcount == 1

    def set_tags(self, run_id: int, tags: list[str]) -> None:
        db = self.db
        with db.conn:
            db.execute("BEGIN IMMEDIATE")
            db.execute("DELETE FROM run_tags WHERE run_id = ?", [run_id])
            for tag in dict.fromkeys(tags):
                db.execute("INSERT INTO run_tags (run_id, tag) VALUES (?, ?)", [run_id, tag])

    def delete_run(self, run_id: int) -> None:
        db = self.db
        with db.conn:
            db.execute("BEGIN IMMEDIATE")
            db.execute("DELETE FROM telemetry WHERE run_id = ?", [run_id])
            db.execute("DELETE FROM telemetry_rollup WHERE run_id = ?", [run_id])
            db.execute("DELETE FROM run_tags WHERE run_id = ?", [run_id])
            db.execute("DELETE FROM calibrations WHERE run_id = ?", [run_id])
            db.execute("DELETE FROM runs WHERE id = ?", [run_id])

    def next_control_seq(self, run_id: int) -> int:
        db = self.db
        with db.conn:
            db.execute("BEGIN IMMEDIATE")
            db.execute("UPDATE runs SET control_seq = control_seq + 1 WHERE id = ?", [run_id])
            row = db.execute("SELECT control_seq FROM runs WHERE id = ?", [run_id]).fetchone()
        return int(row[0])

    def _with_tags(self, rows: list[dict]) -> list[dict]:
        if not rows:
            return rows
        ids = [r["id"] for r in rows]
        marks = ",".join("?" for _ in ids)
        tags: dict[int, list[str]] = {i: [] for i in ids}
        for run_id, tag in self.db.execute(
            f"SELECT run_id, tag FROM run_tags WHERE run_id IN ({marks}) ORDER BY rowid", ids
        ):
            tags[run_id].append(tag)
        out = []
        for r in rows:
            r = dict(r)
            r["config"] = json.loads(r["config"])
            r["error"] = json.loads(r["error"]) if r["error"] else None
            r["summary"] = json.loads(r["summary"]) if r["summary"] else None
            r["tags"] = tags[r["id"]]
            out.append(r)
        return out

    # -- calibrations and tunes ------------------------------------------------------------
    def insert_calibration(
        self,
        run_id: int,
        device: str,
        family: str,
        predicted: dict,
        measured: dict,
        ratios: dict,
        plan: dict,
    ) -> None:
        """Store (or replace) the calibration of ``run_id`` (runtime/plan/feedback.py)."""
        self.db.execute(
            "INSERT OR REPLACE INTO calibrations (run_id, device, family, created_at, predicted,"
            " measured, ratios, plan) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            [run_id, device, family, time.time()]
            + [json.dumps(v) for v in (predicted, measured, ratios, plan)],
        )

    def get_calibration(self, run_id: int) -> dict | None:
        rows = self.db.execute_returning_dicts(
            "SELECT * FROM calibrations WHERE run_id = ?", [run_id]
        )
        return _calibration(rows[0]) if rows else None

    def latest_calibration(self, device: str, family: str) -> dict | None:
        """The newest calibration of ``device`` and ``family`` with a VRAM or step ratio."""
        rows = self.db.execute_returning_dicts(
            "SELECT * FROM calibrations WHERE device = ? AND family = ? AND ratios != '{}'"
            " ORDER BY created_at DESC, run_id DESC LIMIT 1",
            [device, family],
        )
        return _calibration(rows[0]) if rows else None

    def create_tune(
        self, preset: str, budget_mb: float, device: str, trial_steps: int, candidates: list
    ) -> int:
        cur = self.db.execute(
            "INSERT INTO tunes (preset, budget_mb, device, trial_steps, created_at, candidates)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            [preset, budget_mb, device, trial_steps, time.time(), json.dumps(candidates)],
        )
        return int(cur.lastrowid)

    def set_tune_candidates(self, tune_id: int, candidates: list) -> None:
        self.db.execute(
            "UPDATE tunes SET candidates = ? WHERE id = ?", [json.dumps(candidates), tune_id]
        )

    def get_tune(self, tune_id: int) -> dict | None:
        rows = self.db.execute_returning_dicts("SELECT * FROM tunes WHERE id = ?", [tune_id])
        if not rows:
            return None
        row = dict(rows[0])
        row["candidates"] = json.loads(row["candidates"])
        return row

    def list_tunes(self) -> list[dict]:
        rows = self.db.execute_returning_dicts("SELECT * FROM tunes ORDER BY id DESC")
        return [{**r, "candidates": json.loads(r["candidates"])} for r in rows]

    def max_in_steps(self, run_id: int, path: str, source: str = "trainer") -> float | None:
        """The largest ``path`` (a JSON path below the record) of the run's step records of
        ``source``, sampling steps left out."""
        (value,) = self.db.execute(
            "SELECT MAX(json_extract(data, ?)) FROM telemetry WHERE run_id = ? AND source = ?"
            " AND kind = 'step' AND json_extract(data, '$.sampling') IS NULL",
            ["$." + path, run_id, source],
        ).fetchone()
        return value

    def mean_step_ms_after(self, run_id: int, step: int) -> float | None:
        """Mean ``step_time_ms`` of the trainer's step records after ``step`` (1: past the
        trace step), sampling steps left out."""
        (value,) = self.db.execute(
            "SELECT AVG(json_extract(data, '$.step_time_ms')) FROM telemetry WHERE run_id = ?"
            " AND source = 'trainer' AND kind = 'step' AND step > ?"
            " AND json_extract(data, '$.sampling') IS NULL",
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
        the buckets are merged from the rollups instead (``backend.downsample``).
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
        a sampling step's left out (``sampling: true``: its number is also a training step's)."""
        path = "$." + metric
        where = (
            "run_id = ? AND kind = 'step' AND json_extract(data, ?) IS NOT NULL"
            " AND json_extract(data, '$.sampling') IS NULL"
        )
        args: list[Any] = [run_id, path]
        if source:
            where += " AND source = ?"
            args.append(source)
        rows = self.db.execute(
            f"SELECT step, json_extract(data, ?) FROM telemetry WHERE {where} ORDER BY seq",
            [path, *args],
        )
        return [[s, v] for s, v in rows if isinstance(v, (int, float))]

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
        started = self.last_record(run_id, "trainer", "run_started") or {}
        finished = self.last_record(run_id, "trainer", "run_finished") or {}
        return {
            "steps_done": finished.get("steps_done", steps),
            "max_steps": started.get("max_steps"),
            "final_loss": final[0] if final else None,
            "peak_vram_mb": peak,
            "encode_peak_vram_mb": encode_peak,
            "mean_step_time_ms": mean_ms,
            "spill_bytes": int(spill) if spill is not None else None,
            "stall_ms": stall,
        }


def _preset(row: dict) -> dict:
    row = dict(row)
    row["config"] = json.loads(row["config"])
    row["builtin"] = bool(row["builtin"])
    return row


def _calibration(row: dict) -> dict:
    row = dict(row)
    for key in ("predicted", "measured", "ratios", "plan"):
        row[key] = json.loads(row[key])
    return row

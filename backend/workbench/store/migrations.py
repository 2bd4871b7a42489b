"""The database's schema: named migrations applied once each, in order, recorded in
``_migrations`` (``Store.migrate``). Append new ``(name, function)`` pairs to ``MIGRATIONS``;
never edit or reorder applied ones."""

from __future__ import annotations

from collections.abc import Callable

import sqlite_utils


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
    # Min/max rollups (workbench.services.downsample.Chunk), filled at ingest. Runs stored before this
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
    # A finished run's measured figures next to its plan's (backend/workbench/plan/feedback.py), kept
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

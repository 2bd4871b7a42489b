"""Runs in the database: their rows and status moves, tags, control sequence numbers, and the
calibrations and tunes that belong to them."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import sqlite_utils

from workbench.contract.status import check_status_transition


class RunTables:
    """The run queries of ``Store`` (``self.db``: this thread's connection)."""

    db: sqlite_utils.Database
    runs_dir: Path | None

    def create_run(
        self, name: str, preset: str, config: dict, device: str, group_id: int | None = None
    ) -> int:
        """A new queued run; its id is above every id ever given (deleted runs' too) and, with
        ``runs_dir``, is no existing folder's name there (a database emptied beside old run
        folders once gave run 1 again, into run 1's folder). ``group_id``: the tune it is a
        trial of."""
        db = self.db
        with db.conn:
            db.execute("BEGIN IMMEDIATE")
            db.execute(
                "UPDATE run_ids SET last = MAX(last, (SELECT IFNULL(MAX(id), 0) FROM runs)) + 1"
            )
            (run_id,) = db.execute("SELECT last FROM run_ids").fetchone()
            while self.runs_dir is not None and os.path.lexists(self.runs_dir / str(run_id)):
                run_id += 1
            db.execute("UPDATE run_ids SET last = ?", [run_id])
            db.execute(
                "INSERT INTO runs (id, name, preset, config, status, device, created_at,"
                " group_id) VALUES (?, ?, ?, ?, 'queued', ?, ?, ?)",
                [run_id, name, preset, json.dumps(config), device, time.time(), group_id],
            )
        return int(run_id)

    def last_run_id(self) -> int:
        """The highest run id ever given (0 before the first run)."""
        (last,) = self.db.execute("SELECT last FROM run_ids").fetchone()
        return int(last)

    def reserve_run_ids(self, up_to: int) -> None:
        """Never give ids up to ``up_to`` to a new run (a run folder's that has no row)."""
        self.db.execute("UPDATE run_ids SET last = MAX(last, ?)", [up_to])

    def run_ids(self) -> set[int]:
        return {int(i) for (i,) in self.db.execute("SELECT id FROM runs")}

    def adopt_run(self, run_id: int, row: dict[str, Any], tags: list[str]) -> None:
        """Store the row of a run found as a folder only (``workbench.services.adoption``), with
        its given id, and never give that id again. ``row``: columns of ``runs`` (``config``,
        ``error``, ``summary`` as objects). Raises ``sqlite3.IntegrityError`` when the id has a
        row."""
        row = {"id": run_id, **row}
        for key in ("config", "error", "summary"):
            if row.get(key) is not None and not isinstance(row[key], str):
                row[key] = json.dumps(row[key])
        cols = ", ".join(row)
        marks = ", ".join("?" for _ in row)
        db = self.db
        with db.conn:
            db.execute("BEGIN IMMEDIATE")
            db.execute(f"INSERT INTO runs ({cols}) VALUES ({marks})", list(row.values()))
            for tag in dict.fromkeys(tags):
                db.execute("INSERT INTO run_tags (run_id, tag) VALUES (?, ?)", [run_id, tag])
            db.execute("UPDATE run_ids SET last = MAX(last, ?)", [run_id])

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
            workbench.contract.status.RunStatusError: ``fields["status"]`` is not a legal next status of
                every status in ``expected`` (``workbench.contract.status.LEGAL_NEXT``), before anything
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
        """Store (or replace) the calibration of ``run_id`` (backend/workbench/plan/feedback.py)."""
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

    def calibrations_of(self, device: str, family: str, limit: int) -> list[dict]:
        """The newest ``limit`` calibrations of ``device`` and ``family`` with a ratio, newest
        first (``workbench.plan.feedback.combine`` takes their median)."""
        rows = self.db.execute_returning_dicts(
            "SELECT * FROM calibrations WHERE device = ? AND family = ? AND ratios != '{}'"
            " ORDER BY created_at DESC, run_id DESC LIMIT ?",
            [device, family, limit],
        )
        return [_calibration(row) for row in rows]

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


def _calibration(row: dict) -> dict:
    row = dict(row)
    for key in ("predicted", "measured", "ratios", "plan"):
        row[key] = json.loads(row[key])
    return row

"""All SQL of the backend, in one SQLite file: ``Store`` (connections, migrations, presets)
with the run queries of ``runs.py`` and the telemetry queries of ``telemetry.py``; the schema
is ``migrations.py``.

WAL mode so the ingester writes while the API reads. A ``sqlite_utils.Database`` cannot cross
threads, so ``Store`` opens one connection per thread (``threading.local``) on the same file.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import sqlite_utils

from backend.store.migrations import MIGRATIONS
from backend.store.runs import RunTables
from backend.store.telemetry import TelemetryTables

__all__ = ["MIGRATIONS", "Store"]


class Store(RunTables, TelemetryTables):
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


def _preset(row: dict) -> dict:
    row = dict(row)
    row["config"] = json.loads(row["config"])
    row["builtin"] = bool(row["builtin"])
    return row

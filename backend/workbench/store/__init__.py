"""All SQL of the backend, in one SQLite file: ``Store`` (connections, migrations, presets)
with the run queries of ``runs.py`` and the telemetry queries of ``telemetry.py``; the schema
is ``migrations.py``.

WAL mode so the ingester writes while the API reads. A ``sqlite_utils.Database`` cannot cross
threads, so ``Store`` opens one connection per thread (``threading.local``) on the same file.

A damaged file is refused when it is opened (``PRAGMA quick_check``): ``DatabaseDamaged`` names
it and says how to rebuild it from the run folders (``workbench.services.adoption``).
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

import sqlite_utils

from workbench.store.migrations import MIGRATIONS
from workbench.store.runs import RunTables
from workbench.store.telemetry import TelemetryTables

__all__ = ["MIGRATIONS", "DatabaseDamaged", "Store", "is_damage", "set_aside"]

DAMAGE_ERRORS = ("SQLITE_CORRUPT", "SQLITE_NOTADB")
"""SQLite's error names (and their extended ``SQLITE_CORRUPT_*``) for a file that is damaged or
no database at all; "database is locked" or a full disk are other troubles."""


def is_damage(exc: BaseException) -> bool:
    """Whether ``exc`` is SQLite saying the file is damaged or not a database."""
    name = getattr(exc, "sqlite_errorname", None) or ""
    return isinstance(exc, sqlite3.DatabaseError) and name.startswith(DAMAGE_ERRORS)


class DatabaseDamaged(Exception):
    """The database file is damaged, truncated or not a database: its path and how to rebuild."""

    def __init__(self, path: Path, reason: str, runs_dir: Path | None = None) -> None:
        self.path, self.reason = path, reason
        runs = runs_dir if runs_dir is not None else path.parent / "runs"
        super().__init__(
            f"the database {path} is damaged ({reason}). The run folders in {runs} are not "
            "touched by this: each holds its run's config, telemetry, samples, checkpoints and "
            "LoRA files. To rebuild the database from them, start with `workbench serve "
            f"--rebuild-db` (it moves the file aside to {path.name}.damaged-<time> first), or "
            "stop the server, move the file aside yourself and start again: every run folder is "
            "adopted as a run. Run names, notes and tags, your own presets, tunes and "
            "calibrations were kept in the database only."
        )


def set_aside(path: Path, label: str = "damaged") -> Path:
    """Rename the database ``path`` (and its ``-wal`` / ``-shm`` files, which a new file of the
    same name would otherwise read) to ``<name>.<label>-<YYYYmmdd-HHMMSS>``; returns the new
    path of the database. Raises ``OSError`` when a rename fails."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    aside = path.with_name(f"{path.name}.{label}-{stamp}")
    for suffix in ("-wal", "-shm"):
        extra = path.with_name(path.name + suffix)
        if extra.exists():
            extra.rename(aside.with_name(aside.name + suffix))
    path.rename(aside)
    return aside


class Store(RunTables, TelemetryTables):
    """The workbench database at ``path``. Safe to share between threads.

    ``runs_dir``: the run folders (``Settings.runs_dir``); ``create_run`` never gives the id of
    a folder that exists there.

    Raises:
        DatabaseDamaged: ``PRAGMA quick_check`` finds the file damaged, or SQLite reads it as
            no database at all (a truncated file, a text or PNG file of that name).
    """

    def __init__(self, path: str | Path, runs_dir: str | Path | None = None) -> None:
        self.path = Path(path)
        self.runs_dir = Path(runs_dir) if runs_dir is not None else None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()
        self._all: list[sqlite3.Connection] = []
        self._all_lock = threading.Lock()
        try:
            self.check()
            self.migrate()
        except sqlite3.DatabaseError as exc:
            self.close()
            if is_damage(exc):
                raise DatabaseDamaged(self.path, str(exc), self.runs_dir) from exc
            raise
        except BaseException:
            self.close()
            raise

    def check(self) -> None:
        """``PRAGMA quick_check``: every page and index entry readable, O(pages) (0.5 s for a
        90 MB file of 200k records). Raises ``DatabaseDamaged`` with its first findings."""
        found = [row[0] for row in self.db.execute("PRAGMA quick_check")]
        if found != ["ok"]:
            lines = [line for text in found for line in text.splitlines() if "***" not in line]
            raise DatabaseDamaged(self.path, "; ".join(lines[:3]), self.runs_dir)

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

"""Run folders the database has no row for, adopted as runs when the server starts.

A database emptied (a 0-byte ``workbench.db``), rebuilt (``workbench serve --rebuild-db``) or
restored from an older copy beside a ``runs/`` folder knows fewer runs than the folders hold. Left
alone, the next run took id 1 again: it wrote its ``config.json`` into run 1's folder and its
tailer served run 1's old records as its own. Each folder named by an id above the highest id the
database ever gave becomes a run again, rebuilt from what the folder holds:

- ``config.json``: the run's config (its ``name`` is the preset's); a folder without one is not
  adopted (nothing could resume it), but its id is still never given again;
- ``telemetry.jsonl``: ingested as the tailer would (``JsonlTail``), so its records, charts and
  summary are served; its status is the one a restarted server gives a run whose worker is gone
  (``workbench.services.outcome.classify``): the ``run_finished`` record's status, ``failed`` after
  an ``error`` record, else ``crashed``;
- times: ``created_at`` from the first record (or ``config.json``'s mtime), ``started_at`` from
  ``run_started``, ``finished_at`` from the last record.

The run is named ``<preset>-<id>``, tagged ``adopted``, and its notes say where it came from (its
name, notes and tags lived in the database only). A folder at or below the highest id ever given
that has no row is a deleted run's remnant and stays as it is.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stagehand.config.memory import AUTO_DEVICE
from workbench.contract.records import RUN_FINISHED, RUN_STARTED
from workbench.services.outcome import classify, log_tail
from workbench.services.run_files import CONFIG_FILE, servable
from workbench.services.tailer import JsonlTail
from workbench.store import Store

log = logging.getLogger("workbench.services.adoption")

RUN_FOLDER_RE = re.compile(r"^[1-9][0-9]{0,17}$")
"""A run folder's name: its id."""

ADOPTED_TAG = "adopted"


class NotAdoptable(Exception):
    """A run folder that cannot be rebuilt as a run (no readable ``config.json``)."""


@dataclass
class Adoption:
    """What ``adopt_run_folders`` did: the ids adopted, and the folders left as they are with
    why (id -> reason)."""

    adopted: list[int] = field(default_factory=list)
    left: dict[int, str] = field(default_factory=dict)


def folder_ids(runs_dir: Path) -> list[int]:
    """The ids of the entries of ``runs_dir`` named as run folders, ascending."""
    if not runs_dir.is_dir():
        return []
    return sorted(int(p.name) for p in runs_dir.iterdir() if RUN_FOLDER_RE.match(p.name))


def adopt_run_folders(store: Store, runs_dir: Path) -> Adoption:
    """Adopt every folder of ``runs_dir`` named by an id above ``store.last_run_id()`` that has
    no row, and reserve the ids of all folders (new runs' ids continue above them, adopted or
    not). Logs each adoption at WARNING and each folder left out at WARNING."""
    out = Adoption()
    ids = folder_ids(runs_dir)
    if not ids:
        return out
    last, known = store.last_run_id(), store.run_ids()
    for run_id in ids:
        if run_id in known:
            continue
        run_dir = runs_dir / str(run_id)
        if run_id <= last:
            out.left[run_id] = (
                f"id {run_id} was given before and its run deleted; the folder is a remnant"
            )
            continue
        try:
            adopt_folder(store, run_id, run_dir)
        except NotAdoptable as exc:
            out.left[run_id] = str(exc)
            continue
        out.adopted.append(run_id)
    store.reserve_run_ids(ids[-1])
    if out.adopted:
        log.warning(
            "adopted %d run folder(s) of %s that the database %s had no row for: %s "
            "(tagged %r; new runs get ids above %d)",
            len(out.adopted),
            runs_dir,
            store.path,
            ", ".join(map(str, out.adopted)),
            ADOPTED_TAG,
            ids[-1],
        )
    for run_id, why in out.left.items():
        log.warning("run folder %s not adopted: %s", runs_dir / str(run_id), why)
    return out


def adopt_folder(store: Store, run_id: int, run_dir: Path) -> None:
    """Ingest ``run_dir``'s telemetry under ``run_id`` and store the run's row (see the module
    docstring). Raises ``NotAdoptable`` naming the folder when it is a symlink, not a folder, or
    has no ``config.json`` holding a JSON object."""
    if run_dir.is_symlink() or not run_dir.is_dir():
        raise NotAdoptable(f"{run_dir} is not a folder (a symlink or a file)")
    config_path = run_dir / CONFIG_FILE
    try:
        if not servable(config_path, run_dir.resolve()):
            raise ValueError("missing, a symlink or not a regular file")
        config = json.loads(config_path.read_text())
        if not isinstance(config, dict):
            raise ValueError(f"expected a JSON object, got {type(config).__name__}")
    except (OSError, ValueError) as exc:
        raise NotAdoptable(f"{config_path}: no run config to rebuild the run from ({exc})") from exc
    offset = _ingest(store, run_id, run_dir / "telemetry.jsonl")
    started = store.last_record(run_id, *RUN_STARTED) or {}
    last = store.last_record(run_id)
    first = store.telemetry_lines(run_id, -1, 1)
    fields = classify(
        None,
        cancel_requested=False,
        finished=store.last_record(run_id, *RUN_FINISHED),
        last=last,
        tail=log_tail(run_dir / "worker.log"),
        pid=None,
        gone_at_start=True,
    )
    mtime = config_path.stat().st_mtime
    first_time = _time(json.loads(first[0][1])) if first else None
    preset = config.get("name") if isinstance(config.get("name"), str) else "unknown"
    row: dict[str, Any] = {
        **fields,
        "status": str(fields["status"]),
        "name": f"{preset}-{run_id}",
        "preset": preset,
        "config": config,
        "device": AUTO_DEVICE,
        "created_at": min(mtime, first_time) if first_time is not None else mtime,
        "started_at": _time(started),
        "finished_at": _time(last) or mtime,
        "notes": (
            f"Adopted when the server started from its folder {run_dir}: the database "
            f"{store.path} had no row for it. Its name, notes and tags were not in the folder."
        ),
        "summary": store.summary(run_id),
        "tail_offset": offset,
        "last_seq": last["seq"] if last and isinstance(last.get("seq"), int) else -1,
    }
    store.adopt_run(run_id, row, [ADOPTED_TAG])


def _ingest(store: Store, run_id: int, path: Path) -> int:
    """Ingest every complete record of ``path`` (the run's ``telemetry.jsonl``) under
    ``run_id``, as the tailer does; returns the byte offset after the last complete line."""
    if not servable(path, path.parent.resolve()):
        return 0
    tail = JsonlTail(path)
    while True:
        before = tail.offset
        lines = tail.read()
        if tail.offset == before:
            return tail.offset
        store.ingest(run_id, [ln.row() for ln in lines], tail.offset, [ln.record for ln in lines])


def _time(record: dict | None) -> float | None:
    value = (record or {}).get("time")
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

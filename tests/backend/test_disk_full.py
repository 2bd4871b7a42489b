"""A full disk under the data dir (issue 54, finding 2): a run whose worker died is stored as
failed, saying the disk was full, as soon as the database takes writes again, without a restart;
writes answer 507 naming the path and its free bytes; the condition is logged once when it
starts and once when it clears, not once per request or poll.

Two ways to fill it: sqlite's own ``SQLITE_FULL`` ("database or disk is full") from
``PRAGMA max_page_count`` on every connection of the store (no privileges needed), and a real
8 MiB tmpfs filled to its last byte (root with mount(8) rights; skipped otherwise)."""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import subprocess
import threading

import pytest
from backend_helpers import wait_for
from inprocess import IdleExecutor, append_records

from tests.fixtures.disk import fill
from workbench.services import diskfull
from workbench.services.diskfull import DiskCondition, free_bytes, is_disk_full
from workbench.store import Store


class EndingExecutor(IdleExecutor):
    """An ``IdleExecutor`` whose ``ended`` event is set once the supervisor's poll has seen a
    job's exit (its settle runs in that same tick, under the lock a cancel request waits on)."""

    def __init__(self) -> None:
        super().__init__(slots=1)
        self.ended = threading.Event()

    def poll(self, job):
        found = super().poll(job)
        if found is not None:
            self.ended.set()
        return found


NO_LIMIT = 1073741823  # sqlite's default max_page_count before 3.45


def records(n: int) -> list[dict]:
    """``n`` step records of ~1 KB each: more than the pages the database has free."""
    return [
        {
            "seq": i,
            "time": 1.0 + i,
            "source": "trainer",
            "kind": "step",
            "step": i,
            "pad": "x" * 1000,
        }
        for i in range(n)
    ]


@pytest.fixture
def db_full(monkeypatch) -> threading.Event:
    """While the event is set, every connection of ``Store`` (one per thread) refuses to grow the
    database: each use sets ``PRAGMA max_page_count`` below the file's size, which sqlite clamps
    to the size, so a write that needs a page fails with ``SQLITE_FULL``. Meanwhile the free
    bytes the condition watches stay what they were when it filled, as a full disk's do: this
    disk is not full, and the other processes of a test run create and delete files on it (1 MiB
    freed ends a condition, ``FREED_BYTES``; 13 MB freed by them ended one in a suite run)."""
    full = threading.Event()
    real = Store.db.fget

    def db(self):
        found = real(self)
        found.conn.execute(f"PRAGMA max_page_count = {1 if full.is_set() else NO_LIMIT}")
        return found

    frozen: dict[str, int | None] = {}

    def free(path):
        if not full.is_set():
            frozen.clear()
            return free_bytes(path)
        return frozen.setdefault(str(path), free_bytes(path))

    monkeypatch.setattr(Store, "db", property(db))
    monkeypatch.setattr(diskfull, "free_bytes", free)
    return full


def disk_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("workbench.services.disk")]


def check_507(response, path) -> str:
    assert response.status_code == 507, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"code", "message", "field", "details"}
    assert body["error"]["code"] == "disk_full"
    assert body["error"]["field"] is None and body["error"]["details"] == []
    message = body["error"]["message"]
    assert message.startswith(f"disk full at {path}") and " bytes free; " in message, message
    return message


def test_the_errors_of_a_full_disk_are_told_from_others(tmp_path):
    conn = sqlite3.connect(tmp_path / "x.db")
    conn.execute("CREATE TABLE t (x)")
    conn.execute("PRAGMA max_page_count = 1")
    with pytest.raises(sqlite3.OperationalError) as full:
        conn.execute("INSERT INTO t VALUES (zeroblob(100000))")
    assert is_disk_full(full.value)
    fd = os.open("/dev/full", os.O_WRONLY)
    with pytest.raises(OSError) as nospace:
        os.write(fd, b"x")
    os.close(fd)
    assert nospace.value.errno == errno.ENOSPC and is_disk_full(nospace.value)
    try:
        raise RuntimeError("settle failed") from full.value
    except RuntimeError as wrapped:
        assert is_disk_full(wrapped)
    assert not is_disk_full(sqlite3.OperationalError("database is locked"))
    assert not is_disk_full(FileNotFoundError(errno.ENOENT, "gone"))
    assert free_bytes(tmp_path / "not" / "there") == free_bytes(tmp_path) > 0


def test_the_condition_logs_its_start_and_its_end_once(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    disk = DiskCondition(tmp_path)
    for i in range(50):
        disk.failed(OSError(errno.ENOSPC, "No space left on device"), f"write {i}")
    assert disk.full and disk.failures == 50 and disk.status()["full"]
    assert disk.status()["message"].startswith(f"disk full at {tmp_path}: ")
    disk.succeeded("write 51")
    disk.succeeded("write 52")
    assert not disk.full and disk.status()["message"] is None
    assert [m.split(" (")[0] for m in disk_lines(caplog)] == [
        f"disk full at {tmp_path}",
        f"disk writes at {tmp_path} succeed again",
    ]
    assert "after" in disk_lines(caplog)[1] and "50 failed writes" in disk_lines(caplog)[1]


def test_a_dead_worker_s_run_is_stored_once_the_database_takes_writes(
    api_factory, db_full, tmp_path, caplog
):
    caplog.set_level(logging.INFO)
    executor = EndingExecutor()
    api = api_factory(executor=executor)
    data_dir = (tmp_path / "data").resolve()
    run_id = api.post("/api/runs", json={"preset": "tiny-ci"}).json()["id"]
    wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["status"] == "running", 10)

    db_full.set()
    append_records(data_dir, run_id, records(200))  # telemetry the store cannot take
    executor.end(run_id, rc=1)  # the worker died (on the full disk, say)
    assert executor.ended.wait(10)
    assert api.get(f"/api/runs/{run_id}").json()["status"] == "running"  # reads still work
    # Cancel of the dead worker's run tries to store its end now: still full, so 507, not 409.
    check_507(api.post(f"/api/runs/{run_id}/cancel"), data_dir)
    preset = api.get("/api/presets/tiny-ci").json()
    created = api.post(
        "/api/presets", json={"name": "mine", "config": preset["config"], "description": "d" * 2000}
    )
    check_507(created, data_dir)
    assert api.get("/api/system/disk").json()["message"].startswith(f"disk full at {data_dir}")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # no tracebacks
    assert len(disk_lines(caplog)) == 1  # the start of the condition, once

    db_full.clear()
    run = wait_for(
        lambda: (r := api.get(f"/api/runs/{run_id}").json())["status"] != "running" and r,
        10,
        what="the run's end stored",
    )
    assert run["status"] == "failed"
    assert run["exit_code"] == 1
    message = run["error"]["message"]
    assert f"disk full at {data_dir} when the worker ended; its end was stored" in message
    page = api.get(f"/api/runs/{run_id}/telemetry", params={"limit": 1000}).json()
    assert [r["seq"] for r in page["data"]] == list(range(200))  # every record, once
    assert api.get("/api/system/disk").json()["full"] is False
    lines = disk_lines(caplog)
    assert len(lines) == 2 and "succeed again" in lines[1], lines
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_other_storage_errors_keep_their_answer(api, tmp_path):
    def locked():
        raise sqlite3.OperationalError("database is locked")

    def missing():
        open("/nonexistent/x")

    def no_space():
        fd = os.open("/dev/full", os.O_WRONLY)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)

    for path, fn in (("/api/t/locked", locked), ("/api/t/missing", missing)):
        api.app.add_api_route(path, fn, methods=["POST"])
    api.app.add_api_route("/api/t/nospace", no_space, methods=["POST"])
    with pytest.raises(sqlite3.OperationalError):  # the TestClient re-raises a 500's error
        api.post("/api/t/locked")
    with pytest.raises(FileNotFoundError):
        api.post("/api/t/missing")
    check_507(api.post("/api/t/nospace"), (tmp_path / "data").resolve())


@pytest.fixture
def tmpfs(tmp_path):
    """An 8 MiB tmpfs (root with mount(8) rights), unmounted after the test."""
    where = tmp_path / "small"
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(where)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"no tmpfs to fill: mount says {mounted.stderr.decode().strip()!r}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=True)


def test_a_real_full_tmpfs(api_factory, tmpfs, caplog):
    caplog.set_level(logging.INFO)
    data_dir = tmpfs / "data"
    executor = EndingExecutor()
    api = api_factory(executor=executor, data_dir=data_dir)
    data_dir = data_dir.resolve()
    run_id = api.post("/api/runs", json={"preset": "tiny-ci"}).json()["id"]
    wait_for(lambda: api.get(f"/api/runs/{run_id}").json()["status"] == "running", 10)
    append_records(data_dir, run_id, records(50))
    wait_for(lambda: api.get(f"/api/runs/{run_id}/telemetry").json()["count"] == 50, 10)
    preset = api.get("/api/presets/tiny-ci").json()

    filler = fill(tmpfs)
    assert free_bytes(tmpfs) == 0
    executor.end(run_id, rc=1)
    assert executor.ended.wait(10)
    assert api.get(f"/api/runs/{run_id}").json()["status"] == "running"
    check_507(api.post("/api/presets", json={"name": "p", "config": preset["config"]}), data_dir)
    check_507(api.patch(f"/api/runs/{run_id}", json={"notes": "n" * 5000}), data_dir)
    check_507(api.post("/api/runs", json={"preset": "tiny-ci"}), data_dir)
    check_507(api.post(f"/api/runs/{run_id}/cancel"), data_dir)
    status = api.get("/api/system/disk").json()
    assert status["full"] and status["free_bytes"] == 0
    assert status["message"] == f"disk full at {data_dir}: 0 bytes free"
    assert len(disk_lines(caplog)) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]

    os.remove(filler)
    run = wait_for(
        lambda: (r := api.get(f"/api/runs/{run_id}").json())["status"] != "running" and r, 10
    )
    assert run["status"] == "failed"
    assert f"disk full at {data_dir} when the worker ended" in run["error"]["message"]
    assert api.get("/api/system/disk").json()["full"] is False
    assert (
        api.post("/api/presets", json={"name": "p", "config": preset["config"]}).status_code == 201
    )
    assert len(disk_lines(caplog)) == 2

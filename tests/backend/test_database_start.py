"""The database at start (issue 54, findings 3 and 6): an empty ``workbench.db`` beside old run
folders adopts them instead of giving their ids to new runs; a damaged, truncated or foreign
file is refused with its path and how to rebuild it; a table damaged while serving is a 503
naming the file, never a 500.

Every database here is a real SQLite file written by the real ``Store``, beside run folders
written as a server and its worker write them (``write_run_config``, ``telemetry.jsonl`` read
back by the tailer's ``JsonlTail``, checkpoints and LoRA files), then emptied or damaged byte
by byte."""

from __future__ import annotations

from pathlib import Path

import pytest
from backend_helpers import assert_error_body, stored_records
from inprocess import IdleExecutor, append_records, in_process

from workbench.cli.serve import main as serve_main
from workbench.cli.serve import open_store
from workbench.services.adoption import adopt_run_folders
from workbench.services.run_files import RunFolderTaken, write_run_config
from workbench.services.settings import Settings
from workbench.services.tailer import JsonlTail
from workbench.store import DatabaseDamaged, Store

CONFIG = {"name": "tiny-ci", "max_steps": 3}


def record(seq: int, kind: str = "step", source: str = "trainer", **kw) -> dict:
    return {"seq": seq, "time": 1000.0 + seq, "source": source, "kind": kind, "step": seq, **kw}


def started(seq: int = 0) -> dict:
    return record(seq, "run_started", step=None, preset="tiny-ci", max_steps=3, device="cpu")


def steps(first: int, n: int) -> list[dict]:
    return [record(i, loss=1.0 / (i + 1), step_time_ms=10.0) for i in range(first, first + n)]


def earlier_server(data: Path) -> dict[int, list[dict]]:
    """Runs 1-3 as a server left them, in ``data``: rows in ``workbench.db`` (closed, every
    connection on this thread) and folders with config, telemetry, checkpoints and LoRA files.
    Run 1 succeeded (355 records), run 2 failed (an ``error`` record), run 3 crashed (no final
    record); folder ``7`` holds no config (a folder nothing can rebuild). Returns each run's
    records."""
    settings = Settings(data_dir=data)
    store = Store(settings.db_path, runs_dir=settings.runs_dir)
    runs = {
        1: [started(), *steps(1, 353), record(354, "run_finished", step=None, status="succeeded")],
        2: [started(), *steps(1, 4), record(5, "error", message="boom", error_type="ValueError")],
        3: [started(), *steps(1, 6)],
    }
    for run_id, records in runs.items():
        assert store.create_run(f"old-{run_id}", "tiny-ci", CONFIG, "auto") == run_id
        run_dir = settings.runs_dir / str(run_id)
        write_run_config(run_dir, {**CONFIG, "run": run_id})
        append_records(data, run_id, records)
        (run_dir / "checkpoints" / "step-2").mkdir(parents=True)
        (run_dir / "checkpoints" / "step-2" / "adapter.safetensors").write_bytes(b"old" * 10)
        (run_dir / "lora").mkdir()
        (run_dir / "lora" / "lora.safetensors").write_bytes(b"old lora of run %d" % run_id)
        tail = JsonlTail(run_dir / "telemetry.jsonl")
        lines = tail.read()
        store.ingest(run_id, [ln.row() for ln in lines], tail.offset, [ln.record for ln in lines])
    (settings.runs_dir / "7").mkdir()
    store.close()
    return runs


def test_an_empty_database_adopts_the_run_folders_and_new_runs_take_none_of_them(tmp_path):
    data = tmp_path / "data"
    runs = earlier_server(data)
    (data / "workbench.db").write_bytes(b"")  # 0 bytes: the old rows are gone
    old_config = (data / "runs" / "1" / "config.json").read_text()

    client = in_process(data, IdleExecutor(slots=1))
    try:
        listed = {r["id"]: r for r in client.get("/api/runs").json()["data"]}
        assert sorted(listed) == [1, 2, 3]  # folder 7 has no config: not adopted
        statuses = {i: (r["status"], r["preset"], r["name"], r["tags"]) for i, r in listed.items()}
        assert statuses == {
            1: ("succeeded", "tiny-ci", "tiny-ci-1", ["adopted"]),
            2: ("failed", "tiny-ci", "tiny-ci-2", ["adopted"]),
            3: ("crashed", "tiny-ci", "tiny-ci-3", ["adopted"]),
        }
        assert listed[2]["error"]["message"] == "boom"
        assert "gone when the server started" in listed[3]["error"]["message"]
        assert "Adopted when the server started" in listed[1]["notes"]
        assert listed[1]["created_at"] == 1000.0 and listed[1]["finished_at"] == 1354.0
        assert listed[1]["summary"]["steps_done"] == 353
        for run_id, records in runs.items():
            assert stored_records(client, run_id) == records  # served as the old run's
        outputs = client.get("/api/runs/1/outputs").json()
        assert [c["name"] for c in outputs["checkpoints"]] == ["step-2"]

        # A new run continues above every folder (7 included) and writes into none of them.
        resp = client.post("/api/runs", json={"preset": "tiny-ci", "name": "new"})
        assert resp.status_code == 201, resp.text
        new = resp.json()["id"]
        assert new == 8
        assert (data / "runs" / "1" / "config.json").read_text() == old_config
        assert (data / "runs" / "1" / "lora" / "lora.safetensors").read_bytes() == (
            b"old lora of run 1"
        )
        assert stored_records(client, new) == []
        assert client.get(f"/api/runs/{new}/outputs").json()["checkpoints"] == []
    finally:
        client.__exit__(None, None, None)

    # A second start adopts nothing again: the rows are there now.
    store = Store(data / "workbench.db", runs_dir=data / "runs")
    try:
        again = adopt_run_folders(store, data / "runs")
        assert again.adopted == [] and set(again.left) == {7}
        assert store.create_run("next", "tiny-ci", CONFIG, "auto") == 9
    finally:
        store.close()


def test_a_deleted_runs_leftover_folder_is_not_adopted_and_no_id_is_given_twice(tmp_path):
    data = tmp_path / "data"
    store = Store(data / "workbench.db", runs_dir=data / "runs")
    try:
        first = store.create_run("a", "tiny-ci", CONFIG, "auto")
        write_run_config(data / "runs" / str(first), CONFIG)
        store.delete_run(first)  # its folder stays (a failed rmtree)
        done = adopt_run_folders(store, data / "runs")
        assert done.adopted == [] and "given before" in done.left[first]
        assert store.get_run(first) is None
        # A folder created behind the store's back is never given to a new run.
        (data / "runs" / "2").mkdir()
        (data / "runs" / "3").symlink_to(tmp_path)
        assert store.create_run("b", "tiny-ci", CONFIG, "auto") == 4
        with pytest.raises(RunFolderTaken, match=r"run folder .*/runs/3 exists already"):
            write_run_config(data / "runs" / "3", CONFIG)
    finally:
        store.close()


def damaged_pages(path: Path) -> None:
    """Overwrite 16 KiB in the middle of ``path`` (several pages of the telemetry table)."""
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2 // 4096 * 4096)
        f.write(b"\xa5" * 16384)


def foreign_png(path: Path) -> None:
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 8)


@pytest.mark.parametrize(
    "spoil",
    [
        pytest.param(damaged_pages, id="damaged-pages"),
        pytest.param(
            lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 3]), id="truncated"
        ),
        pytest.param(lambda p: p.write_text("my notes\n" * 100), id="text-file"),
        pytest.param(foreign_png, id="png-file"),
    ],
)
def test_a_spoilt_database_is_refused_at_start_with_its_path_and_the_way_to_rebuild(
    tmp_path, capsys, spoil
):
    data = tmp_path / "data"
    earlier_server(data)
    db = data / "workbench.db"
    spoil(db)
    spoilt = db.read_bytes()

    with pytest.raises(DatabaseDamaged) as caught:
        in_process(data)
    message = str(caught.value)
    assert str(db) in message and str(data / "runs") in message
    assert "--rebuild-db" in message and "move the file aside" in message

    # `workbench serve` prints that one message (no traceback), exits 2, and starts nothing.
    assert serve_main(["--data-dir", str(data), "--no-browser", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"workbench serve: the database {db} is damaged (")
    assert "Traceback" not in err and "--rebuild-db" in err
    assert db.read_bytes() == spoilt  # refused, not touched

    # --rebuild-db: the file goes aside as it was, the runs come back from their folders.
    settings = Settings(data_dir=data)
    store = open_store(settings, rebuild=True)
    store.close()
    aside = [p for p in data.glob("workbench.db.damaged-*") if not p.name.endswith(("wal", "shm"))]
    assert len(aside) == 1 and aside[0].read_bytes() == spoilt  # its -wal/-shm went with it
    client = in_process(data)
    try:
        listed = client.get("/api/runs").json()["data"]
        assert sorted(r["id"] for r in listed) == [1, 2, 3]
        assert {r["status"] for r in listed} == {"succeeded", "failed", "crashed"}
    finally:
        client.__exit__(None, None, None)


def test_a_healthy_database_is_kept_by_rebuild_db(tmp_path):
    data = tmp_path / "data"
    earlier_server(data)
    store = open_store(Settings(data_dir=data), rebuild=True)
    try:
        assert [r["name"] for r in store.list_runs()] == ["old-3", "old-2", "old-1"]
    finally:
        store.close()
    assert [p.name for p in data.iterdir() if p.name.startswith("workbench.db.")] == []


def test_a_table_damaged_while_serving_answers_503_naming_the_database(tmp_path):
    data = tmp_path / "data"
    earlier_server(data)
    db = data / "workbench.db"
    client = in_process(data)
    client._transport.raise_server_exceptions = False  # the answer, as a browser would get it
    try:
        damaged_pages(db)  # after the start's check: no request has read these pages yet
        answers = [client.get("/api/runs")]
        for run_id in (1, 2, 3):
            answers.append(client.get(f"/api/runs/{run_id}/telemetry", params={"limit": 10000}))
            answers.append(client.get(f"/api/runs/{run_id}"))
        codes = [r.status_code for r in answers]
        assert 500 not in codes and set(codes) <= {200, 503}, codes
        assert 503 in codes, codes
        for resp in answers:
            if resp.status_code == 503:
                err = assert_error_body(resp, 503)
                assert err["code"] == "database_damaged"
                assert str(db) in err["message"] and "--rebuild-db" in err["message"]
                assert str(data / "runs") in err["message"]
    finally:
        client.__exit__(None, None, None)


def test_workbench_plan_with_a_damaged_database_plans_without_calibration(tmp_path, capsys):
    """``workbench plan`` reads the server's calibration from ``DATA/workbench.db``: a foreign
    file there is named on stderr and the plan is the one modelled, not a traceback."""
    from workbench.cli.plan import calibrated

    (tmp_path / "workbench.db").write_text("not a database\n" * 100)
    plan = {"step_ms": 1.0}
    assert calibrated(plan, "cpu", {"family": "flux"}, str(tmp_path)) is plan
    err = capsys.readouterr().err
    assert err.startswith("workbench plan: no calibration applied: ")
    assert str(tmp_path / "workbench.db") in err

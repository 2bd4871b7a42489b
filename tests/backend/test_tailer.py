"""The tailer: a torn last line is held back until complete, and NaN/Infinity become null."""

from __future__ import annotations

import json

from backend_helpers import rec

from workbench.services.tailer import JsonlTail
from workbench.store import Store


def test_tail_holds_a_torn_line_until_complete(tmp_path):
    path = tmp_path / "telemetry.jsonl"
    tail = JsonlTail(path)
    assert tail.read() == []  # no file yet
    line0, line1 = rec(0, loss=1.5), rec(1, loss=0.5)
    path.write_text(line0 + "\n" + line1[:10])
    got = tail.read()
    assert [ln.seq for ln in got] == [0] and tail.offset == len(line0) + 1
    assert tail.read() == []  # still torn
    with open(path, "a") as f:
        f.write(line1[10:] + "\n")
    got = tail.read()
    assert [ln.raw for ln in got] == [line1]
    with open(path, "a") as f:
        f.write("not json\n" + rec(2) + "\n")
    assert [ln.seq for ln in tail.read()] == [2] and tail.skipped == 1
    # A new tail resumed from the stored offset reads nothing twice.
    assert JsonlTail(path, tail.offset).read() == []


def test_nan_and_infinity_become_null_in_the_stored_line(tmp_path):
    from workbench.services.tailer import parse_line

    line = parse_line('{"seq": 3, "kind": "step", "loss": NaN, "x": {"y": -Infinity}, "z": 1}')
    assert json.loads(line.raw) == {
        "seq": 3,
        "kind": "step",
        "loss": None,
        "x": {"y": None},
        "z": 1,
    }
    plain = rec(4, loss=0.5)
    assert parse_line(plain).raw == plain  # standard JSON is kept byte for byte
    # A seq written as a string is still a record, and is rolled up under its number.
    lines = [
        parse_line('{"seq": "7", "source": "s", "kind": "k", "v": 2}'),
        parse_line('{"seq": 8, "source": "s", "kind": "k", "v": 1}'),
    ]
    store = Store(tmp_path / "db.sqlite")
    run_id = store.create_run("r", "p", {}, "default")
    assert store.ingest(run_id, [ln.row() for ln in lines], 1, [ln.record for ln in lines]) == 2
    got, last = store.bucket_stats(run_id, -1, "s", "k", 4, ["v"], 10)
    assert last == 8 and [b["max"] for b in got] == [{"v": 2}, {"v": 1}]
    rollup = "SELECT seq_first, seq_last, count FROM telemetry_rollup"
    assert store.db.execute(rollup).fetchall() == [(7, 8, 2)]
    store.close()


def test_the_poll_thread_sleeps_while_no_run_is_watched(tmp_path):
    """Idle, the tailer's thread waits for ``watch`` (no poll at all); watching, it polls every
    ``interval_s`` and ingests; once the run is drained and forgotten it sleeps again."""
    import asyncio
    import threading
    import time

    from workbench.services.hub import Hub
    from workbench.services.tailer import Tailer

    store = Store(tmp_path / "db.sqlite")
    run_id = store.create_run("r", "p", {}, "default")
    tailer = Tailer(store, Hub(asyncio.new_event_loop()), interval_s=0.01)
    polls = []
    polled = threading.Event()
    plain_poll = tailer.poll_once

    def counted() -> None:
        polls.append(time.monotonic())
        plain_poll()
        polled.set()

    tailer.poll_once = counted
    tailer.start()
    try:
        time.sleep(0.3)  # 30 polls' worth at 100 Hz
        assert polls == []
        path = tmp_path / "telemetry.jsonl"
        path.write_text(rec(0, loss=1.0) + "\n" + rec(1, loss=0.5) + "\n")
        tailer.watch(run_id, JsonlTail(path))
        assert polled.wait(10)
        deadline = time.monotonic() + 10
        while store.db.execute("SELECT count(*) FROM telemetry").fetchone()[0] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        tailer.drain(run_id)
        forgotten = len(polls)
        time.sleep(0.3)
        # At most the poll already under way when the run was forgotten (a starved thread may
        # start it late), none after it: 100 Hz polling would add ~30.
        assert len(polls) <= forgotten + 1
    finally:
        tailer.stop()
        store.close()
    assert not tailer._thread.is_alive()

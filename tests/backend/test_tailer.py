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

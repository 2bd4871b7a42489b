import json

import pytest

from stagehand.common.telemetry import JsonlSink, ListSink, Telemetry


def test_envelope_and_increasing_seq():
    sink = ListSink()
    tel = Telemetry(sink)
    tel.step, tel.phase = 3, "forward"
    a = tel.emit("stagehand", "block", event="load", block=2)
    b = tel.emit("trainer", "step", loss=0.5)
    assert [a["seq"], b["seq"]] == [0, 1]
    assert a["step"] == 3 and a["phase"] == "forward" and a["block"] == 2
    assert sink.of(source="trainer") == [b]


def test_jsonl_resume_cuts_a_torn_line_and_continues_seq(tmp_path):
    path = tmp_path / "telemetry.jsonl"
    tel = Telemetry(JsonlSink(path))
    for i in range(3):
        tel.emit("trainer", "step", loss=float(i))
    tel.close()
    with open(path, "a") as f:  # a crash mid-write leaves a torn last line
        f.write('{"seq": 3, "sour')
    resumed = Telemetry(JsonlSink(path))
    assert resumed.next_seq == 3
    rec = resumed.emit("trainer", "step", loss=float("nan"))
    resumed.close()
    assert rec["seq"] == 3
    # Every line is a whole record: the resumed one is not glued to the torn half.
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["seq"] for r in lines] == [0, 1, 2, 3]
    assert lines[-1]["loss"] is None  # NaN is not JSON: written as null


def test_jsonl_resume_finishes_a_whole_record_missing_its_newline(tmp_path):
    path = tmp_path / "telemetry.jsonl"
    tel = Telemetry(JsonlSink(path))
    tel.emit("trainer", "step", loss=1.0)
    tel.close()
    path.write_bytes(path.read_bytes().rstrip(b"\n"))  # killed before the newline reached disk
    resumed = Telemetry(JsonlSink(path))
    assert resumed.next_seq == 1
    resumed.emit("trainer", "step", loss=2.0)
    resumed.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["seq"], r["loss"]) for r in lines] == [(0, 1.0), (1, 2.0)]


def test_flush_makes_lines_visible_to_a_reader(tmp_path):
    path = tmp_path / "t.jsonl"
    tel = Telemetry(JsonlSink(path))
    tel.emit("trainer", "step", loss=1.0)
    tel.flush()
    assert json.loads(path.read_text())["loss"] == 1.0
    tel.close()


def test_non_json_values_are_stringified(tmp_path):
    path = tmp_path / "t.jsonl"
    tel = Telemetry(JsonlSink(path))
    tel.emit("trainer", "event", where=tmp_path, ids={1})
    tel.close()
    rec = json.loads(path.read_text())
    assert rec["where"] == str(tmp_path) and rec["ids"] == [1]


def test_default_sink_drops_records():
    tel = Telemetry()
    tel.emit("x", "y")
    assert tel.next_seq == 1
    with pytest.raises(TypeError):
        tel.emit("x")  # kind is required


def test_a_time_bound_flushes_records_without_a_step(tmp_path):
    """With ``flush_interval_s`` a record reaches the file within the bound though nobody calls
    ``flush`` (stage 1's progress); without it the line stays in the writer's buffer."""
    import time

    bounded = Telemetry(JsonlSink(tmp_path / "bounded.jsonl"), flush_interval_s=0.05)
    plain = Telemetry(JsonlSink(tmp_path / "plain.jsonl"))
    bounded.emit("trainer", "stage", stage="cache", done=1, total=9)
    plain.emit("trainer", "stage", stage="cache", done=1, total=9)
    deadline = time.monotonic() + 5
    while not (tmp_path / "bounded.jsonl").read_text() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert '"done":1' in (tmp_path / "bounded.jsonl").read_text()
    assert (tmp_path / "plain.jsonl").read_text() == ""
    bounded.close()
    plain.close()
    assert '"done":1' in (tmp_path / "plain.jsonl").read_text()
    with pytest.raises(ValueError, match="flush_interval_s must be > 0"):
        Telemetry(flush_interval_s=0)


def test_a_failed_time_bound_flush_fails_the_next_emit_with_its_error(tmp_path):
    """A full disk met by the flusher thread is raised on the writer's side at its next
    ``emit`` (not lost in the thread, nor replaced by a later, different error); a file that
    cannot be synced (``/dev/full``: ``fsync`` gives EINVAL) is flushed, not failed."""
    import errno
    import time

    (tmp_path / "full.jsonl").symlink_to("/dev/full")  # every write: ENOSPC
    telemetry = Telemetry(JsonlSink(tmp_path / "full.jsonl"), flush_interval_s=0.02)
    telemetry.emit("trainer", "stage", stage="cache", done=1, total=9)
    deadline = time.monotonic() + 5
    while telemetry._error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(OSError) as raised:
        telemetry.emit("trainer", "stage", stage="cache", done=2, total=9)
    assert raised.value.errno == errno.ENOSPC
    with pytest.raises(OSError, match="No space left on device"):
        telemetry.flush()
    empty = JsonlSink(tmp_path / "full.jsonl")
    empty.flush()  # nothing buffered: only the fsync, which /dev/full refuses with EINVAL

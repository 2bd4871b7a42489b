"""In-process checks of the tailer, the store, downsampling and the config diff."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from backend.api.compare import config_diff
from backend.downsample import bucketize
from backend.store import MIGRATIONS, Store
from backend.tailer import JsonlTail


def rec(seq: int, **kw) -> str:
    return json.dumps(
        {
            "seq": seq,
            "time": 1.0,
            "source": "trainer",
            "kind": "step",
            "step": seq,
            "phase": None,
            **kw,
        }
    )


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
    from backend.tailer import parse_line

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


def test_store_ingest_is_idempotent_and_migrations_run_once(tmp_path):
    store = Store(tmp_path / "db.sqlite")
    assert store.migrate() == []  # already applied by the constructor
    names = [r["name"] for r in store.db["_migrations"].rows]
    assert names == [name for name, _ in MIGRATIONS]
    run_id = store.create_run("r", "p", {"a": 1}, "default")
    rows = [(i, 1.0, "trainer", "step", i, None, rec(i, loss=float(i))) for i in range(5)]
    assert store.ingest(run_id, rows[:3], 30) == 3
    assert store.ingest(run_id, rows, 50) == 2  # the first three are already stored
    assert [s for s, _ in store.telemetry_lines(run_id)] == [0, 1, 2, 3, 4]
    run = store.get_run(run_id)
    assert run["tail_offset"] == 50 and run["last_seq"] == 4
    assert store.summary(run_id)["final_loss"] == 4.0
    extra = (5, 1.0, "trainer", "step", 5, None, rec(5, loss=5.0))
    assert store.ingest(run_id, [extra, extra], 60) == 1  # twice in one batch: stored once
    rolled = "SELECT SUM(count) FROM telemetry_rollup WHERE run_id = ?"
    assert store.db.execute(rolled, [run_id]).fetchone()[0] == 6  # and rolled up once
    store.close()


def test_buckets_keep_peaks():
    records = [{"seq": i, "step": i, "loss": 1.0, "phase_ms": {"forward": 2.0}} for i in range(100)]
    records[37]["loss"] = 99.0
    records[80]["loss"] = -5.0
    out = bucketize(records, 10)
    assert len(out) == 10 and sum(b["count"] for b in out) == 100
    assert out[3]["max"]["loss"] == 99.0 and out[3]["seq"] == 30 and out[3]["seq_last"] == 39
    assert out[8]["min"]["loss"] == -5.0
    assert out[0]["max"]["phase_ms.forward"] == 2.0 and "seq" not in out[0]["max"]
    assert len(bucketize(records[:3], 10)) == 3


def test_config_diff_lists_only_differing_paths():
    a = {"memory": {"strategy": "none", "x": 1}, "lr": 1e-4, "name": "a"}
    b = {"memory": {"strategy": "stagehand", "x": 1}, "lr": 1e-4, "name": "a", "new": True}
    diff = config_diff({1: a, 2: b})
    assert diff == [
        {"path": "memory.strategy", "values": {"1": "none", "2": "stagehand"}},
        {"path": "new", "values": {"1": None, "2": True}},
    ]


def test_hub_batches_for_slow_clients_and_closes_the_hopeless():
    import asyncio
    import concurrent.futures

    from backend.hub import Hub, SubscriberState

    async def scenario():
        hub = Hub(asyncio.get_running_loop(), max_pending=18)
        fast, slow = hub.subscribe(1), hub.subscribe(1)
        hub.publish_lines(1, [(0, "{}"), (1, "{}")])
        hub.publish_lines(1, [(2, "{}")])
        hub.publish_run(1, {"status": "running"})
        await asyncio.sleep(0)
        items = await fast.take()
        assert [k for k, _ in items] == ["lines", "lines", "run"]
        assert [s for _, b in items[:2] for s, _ in b.lines] == [0, 1, 2]
        assert items[0][1].frame == '{"records":[{},{}]}'
        hub.publish_lines(1, [(i, "{}") for i in range(3, 20)])  # slow: 3 + 17 = 20 > 18 behind
        await asyncio.sleep(0)
        assert slow.state is SubscriberState.OVERFLOWED and fast.state is SubscriberState.LIVE
        assert await slow.take() == []
        assert len((await fast.take())[0][1].lines) == 17
        hub.unsubscribe(fast)
        hub.unsubscribe(slow)
        assert hub.subscribers(1) == 0

    # In a thread of its own: a browser test run earlier in this process leaves Playwright's
    # event loop running in the main thread, where asyncio.run refuses to start.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(asyncio.run, scenario()).result()


def test_outcome_from_exit_and_last_records():
    from backend.outcome import classify

    fin = {"seq": 9, "source": "trainer", "kind": "run_finished", "status": "cancelled"}
    err = {
        "seq": 5,
        "source": "trainer",
        "kind": "error",
        "step": 3,
        "message": "CUDA out of memory",
        "error_type": "OutOfMemoryError",
        "traceback": "Traceback...",
        "oom": True,
    }
    step = {"seq": 4, "source": "trainer", "kind": "step", "step": 3}
    kw = {"tail": "log", "pid": 42}
    killed = classify(-9, cancel_requested=False, finished=None, last=step, **kw)
    assert (killed["status"], killed["signal"]) == ("killed", "SIGKILL")
    assert (
        classify(-15, cancel_requested=True, finished=None, last=step, **kw)["status"]
        == "cancelled"
    )
    assert classify(0, cancel_requested=True, finished=fin, last=fin, **kw)["status"] == "cancelled"
    assert classify(None, cancel_requested=False, finished=fin, last=fin, **kw)["error"] is None
    failed = classify(1, cancel_requested=False, finished=None, last=err, **kw)
    assert failed["status"] == "failed" and failed["error"]["oom"] is True
    assert failed["error"]["message"] == "CUDA out of memory"
    crashed = classify(
        None, cancel_requested=False, finished=None, last=step, gone_at_start=True, **kw
    )
    assert crashed["status"] == "crashed"
    assert (
        "pid 42" in crashed["error"]["message"]
        and "trainer/step at step 3 (seq 4)" in crashed["error"]["message"]
    )
    early = classify(2, cancel_requested=False, finished=None, last=None, **kw)
    assert early["status"] == "failed" and early["error"]["log_tail"] == "log"
    assert "code 2 after no telemetry" in early["error"]["message"]
    removed = classify(
        1, cancel_requested=False, finished=None, last=step, **kw, missing_dir=Path("/d/7")
    )
    assert removed["status"] == "failed" and removed["error"]["message"] == (
        "the run folder /d/7 no longer exists (removed while the run was going?); worker exited "
        "with code 1 after trainer/step at step 3 (seq 4)"
    )


def test_sql_buckets_equal_the_python_reference(tmp_path):
    import random

    from backend.downsample import numeric_paths

    rng = random.Random(0)
    store = Store(tmp_path / "db.sqlite")
    run_id = store.create_run("r", "p", {}, "default")
    rows = []
    for i in range(2000):
        kind = "step" if i % 5 == 0 else "block"
        line = rec(
            i,
            kind=kind,
            loss=rng.random(),
            vram_peak_mb=float(i % 97),
            ok=True,
            phase_ms={"forward": rng.random()},
            block_name="b",
        )
        rows.append((i, 1.0, "trainer", kind, i, None, line))
    store.ingest(run_id, rows, 1)
    for kind, buckets, since in (("block", 37, -1), (None, 2000, 10), ("step", 999, 100)):
        paths = numeric_paths(store.sample_lines(run_id, since, None, kind))
        assert paths == ["loss", "phase_ms.forward", "vram_peak_mb"]
        got, last = store.bucket_stats(run_id, since, None, kind, buckets, paths, 10**6)
        ref = bucketize(
            [json.loads(x) for _, x in store.telemetry_lines(run_id, since, 10**6, None, kind)],
            buckets,
        )
        assert got == ref and last == ref[-1]["seq_last"]
    store.close()


def test_rollups_folded_at_ingest_give_the_extremes_of_long_runs(tmp_path):
    import random

    from backend.downsample import CHUNK, ROLLUP_MIN_RECORDS, fold, merge_chunks

    rng = random.Random(1)
    records, kinds = [], []
    for i in range(ROLLUP_MIN_RECORDS + 3000):
        kind = "block" if rng.random() < 0.93 else "step"
        kinds.append(kind)
        records.append(
            json.loads(rec(i, kind=kind, vram=rng.random() * 100, blk=i % 7, ok=True, x={"y": i}))
        )
    records[12_345]["vram"] = 1000.0  # one spike
    rows = [
        (r["seq"], r["time"], "trainer", k, r["step"], None, json.dumps(r))
        for r, k in zip(records, kinds, strict=True)
    ]
    path = tmp_path / "db.sqlite"
    store = Store(path)
    run_id = store.create_run("r", "p", {}, "default")
    for i in range(0, 12_000, 997):  # odd batches, one ingested twice
        store.ingest(run_id, rows[i : i + 997], 1)
    store.ingest(run_id, rows[2 * 997 : 3 * 997], 1)
    store.close()
    store = Store(path)  # a restarted backend continues the open chunk from the database
    store.ingest(run_id, rows[11_000:], 1, records[11_000:])

    blocks = [r for r, k in zip(records, kinds, strict=True) if k == "block"]
    assert len(blocks) > ROLLUP_MIN_RECORDS
    got, last = store.bucket_stats(run_id, -1, "trainer", "block", 300, ["vram", "x.y"], 10**6)
    # Folding batch by batch across two Store instances equals folding everything at once.
    assert got == merge_chunks(fold(None, blocks), 300, ["vram", "x.y"])
    assert len(got) == 300 and last == blocks[-1]["seq"]
    assert sum(b["count"] for b in got) == len(blocks)
    assert all(b["count"] % CHUNK == 0 for b in got[:-1])
    by_seq = {r["seq"]: r for r in blocks}
    for a, b in itertools.pairwise(got):
        assert a["seq_last"] < b["seq"]
    for b in got:
        inside = [r for s, r in by_seq.items() if b["seq"] <= s <= b["seq_last"]]
        assert len(inside) == b["count"]
        assert b["max"] == {"vram": max(r["vram"] for r in inside), "x.y": inside[-1]["seq"]}
        assert b["min"]["vram"] == min(r["vram"] for r in inside)
        assert b["step"] == min(r["step"] for r in inside)
    assert max(b["max"]["vram"] for b in got) == 1000.0
    # Fewer records than the rollup threshold (the step kind) are still bucketed exactly.
    exact, _ = store.bucket_stats(run_id, -1, "trainer", "step", 50, ["vram"], 10**6)
    steps = [r for r, k in zip(records, kinds, strict=True) if k == "step"]
    assert exact == [
        {**b, "min": {"vram": b["min"]["vram"]}, "max": {"vram": b["max"]["vram"]}}
        for b in bucketize(steps, 50)
    ]
    # A run stored before rollups existed gets them on its first bucketed read: the same rows.
    table = "SELECT * FROM telemetry_rollup WHERE kind = 'block' ORDER BY chunk"
    ingested = store.db.execute(table).fetchall()
    store.db.execute("DELETE FROM telemetry_rollup WHERE chunk >= 5")  # and a partial one
    assert store.bucket_stats(run_id, -1, "trainer", "block", 300, ["vram", "x.y"], 10**6) == (
        got,
        last,
    )
    assert store.db.execute(table).fetchall() == ingested
    store.db.execute("DELETE FROM telemetry_rollup")
    assert store.bucket_stats(run_id, -1, "trainer", "block", 300, ["vram", "x.y"], 10**6)[0] == got
    store.delete_run(run_id)
    assert store.db.execute("SELECT COUNT(*) FROM telemetry_rollup").fetchone()[0] == 0
    store.close()


def test_summary_peak_vram_per_stage(tmp_path):
    """Stage 1's step records (before the trainer's first "train" stage record) give
    ``encode_peak_vram_mb``; the training stage's give ``peak_vram_mb``, which Compare uses."""

    def row(seq, source, kind, **fields):
        data = json.dumps({"seq": seq, "time": 1.0, "source": source, "kind": kind, **fields})
        return (seq, 1.0, source, kind, fields.get("step"), None, data)

    store = Store(tmp_path / "db.sqlite")
    run_id = store.create_run("r", "p", {}, "default")
    rows = [
        row(0, "trainer", "stage", stage="cache", done=0, total=2),
        row(1, "stagehand", "step", step=0, vram_peak_mb=52.8),  # the text encoder, streamed
        row(2, "trainer", "stage", stage="train", done=0, total=2),
    ]
    store.ingest(run_id, rows, 10)
    assert store.summary(run_id)["encode_peak_vram_mb"] == 52.8
    assert store.summary(run_id)["peak_vram_mb"] is None  # no training step yet
    other = store.create_run("writer", "p", {}, "default")  # a worker without stage records
    store.ingest(other, [row(0, "trainer", "step", step=0, vram_peak_mb=9.0, loss=1.0)], 10)
    assert store.summary(other)["peak_vram_mb"] == 9.0
    assert store.summary(other)["encode_peak_vram_mb"] is None
    rows = [
        row(3, "stagehand", "step", step=0, vram_peak_mb=36.0),
        row(4, "trainer", "step", step=0, vram_peak_mb=35.5, loss=1.0),
    ]
    store.ingest(run_id, rows, 20)
    summary = store.summary(run_id)
    assert summary["peak_vram_mb"] == 36.0 and summary["encode_peak_vram_mb"] == 52.8
    # A sampling step's records (same step number) stay out of the series Compare draws.
    store.ingest(
        run_id, [row(5, "stagehand", "step", step=0, vram_peak_mb=99.0, sampling=True)], 30
    )
    assert [v for _, v in store.series(run_id, "vram_peak_mb", "stagehand")] == [52.8, 36.0]
    store.close()


def test_run_ids_are_never_given_again_after_a_delete(tmp_path):
    store = Store(tmp_path / "db.sqlite")
    first = store.create_run("a", "p", {}, "default")
    second = store.create_run("b", "p", {}, "default")
    store.delete_run(second)  # the newest: plain SQLite would give its id to the next run
    third = store.create_run("c", "p", {}, "default")
    assert (first, second, third) == (1, 2, 3)
    store.close()
    reopened = Store(tmp_path / "db.sqlite")
    reopened.delete_run(third)
    assert reopened.create_run("d", "p", {}, "default") == 4
    reopened.close()

"""The store: idempotent ingest, migrations once, SQL buckets and rollups against the Python
reference, the run summary, Compare's series of a resumed run, run ids never given again."""

from __future__ import annotations

import itertools
import json

from backend_helpers import rec

from workbench.services.downsample import bucketize
from workbench.store import MIGRATIONS, Store


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


def test_sql_buckets_equal_the_python_reference(tmp_path):
    import random

    from workbench.services.downsample import numeric_paths

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

    from workbench.services.downsample import CHUNK, ROLLUP_MIN_RECORDS, fold, merge_chunks

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
    # The weights mode: the last stagehand step record's (none said one yet).
    assert store.summary(run_id)["weights_mode"] is None
    rows = [
        row(
            3,
            "stagehand",
            "step",
            step=0,
            vram_peak_mb=36.0,
            weights_mode="host-cache",
            weights_mode_reason="within the cache",
        ),
        row(4, "trainer", "step", step=0, vram_peak_mb=35.5, loss=1.0),
    ]
    store.ingest(run_id, rows, 20)
    summary = store.summary(run_id)
    assert summary["peak_vram_mb"] == 36.0 and summary["encode_peak_vram_mb"] == 52.8
    assert (summary["weights_mode"], summary["weights_mode_reason"]) == (
        "host-cache",
        "within the cache",
    )
    assert summary["weights_squareq"] is None  # full precision
    store.ingest(run_id, [row(5, "squareq", "step", step=1, note="SquareQ int8: 0.52x")], 25)
    assert store.summary(run_id)["weights_squareq"] == "SquareQ int8: 0.52x"
    # A sampling step's records (same step number) stay out of the series Compare draws.
    store.ingest(
        run_id, [row(6, "stagehand", "step", step=0, vram_peak_mb=99.0, sampling=True)], 30
    )
    assert [v for _, v in store.series(run_id, "vram_peak_mb", "stagehand")] == [52.8, 36.0]
    # So do an attempt's that ran out of memory (its rerun draws the step), here step 1's.
    store.ingest(
        run_id,
        [
            row(7, "stagehand", "step", step=1, vram_peak_mb=80.0, aborted=True),
            row(8, "stagehand", "step", step=1, vram_peak_mb=30.0),
        ],
        35,
    )
    assert [v for _, v in store.series(run_id, "vram_peak_mb", "stagehand")] == [52.8, 36.0, 30.0]
    assert store.step_record(run_id, "stagehand", 1)["vram_peak_mb"] == 30.0
    store.close()


def test_compare_series_draws_each_step_of_a_resumed_run_once(tmp_path):
    """A worker killed after step 5 (and mid-step 6) is resumed from its step-3 checkpoint: its
    ``trainer/resumed`` record at step 3 leaves the discarded run's steps 4-6 out of the series,
    the resumed run's steps 4-7 in, every record stored."""

    def row(seq, source, kind, step, **fields):
        data = json.dumps({"seq": seq, "time": 1.0, "source": source, "kind": kind, "step": step})
        return (seq, 1.0, source, kind, step, None, data[:-1] + ", " + json.dumps(fields)[1:])

    store = Store(tmp_path / "db.sqlite")
    run_id = store.create_run("r", "p", {}, "default")
    killed = [row(n - 1, "trainer", "step", n, loss=1.0 / n) for n in range(1, 6)]
    killed.append(row(5, "stagehand", "step", 6, blocks_loaded=60))
    store.ingest(run_id, killed, 10)
    resumed = [row(6, "trainer", "resumed", 3, checkpoint="checkpoints/step-3")]
    resumed += [row(3 + n, "trainer", "step", n, loss=2.0 / n) for n in range(4, 8)]
    resumed.append(row(11, "stagehand", "step", 6, blocks_loaded=61))
    store.ingest(run_id, resumed, 20)
    assert len(store.telemetry_lines(run_id)) == 12
    assert store.series(run_id, "loss", "trainer") == [
        [1, 1.0], [2, 0.5], [3, 1.0 / 3], [4, 0.5], [5, 0.4], [6, 2.0 / 6], [7, 2.0 / 7]
    ]  # fmt: skip
    assert store.series(run_id, "blocks_loaded", "stagehand") == [[6, 61]]
    assert store.summary(run_id)["final_loss"] == 2.0 / 7
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

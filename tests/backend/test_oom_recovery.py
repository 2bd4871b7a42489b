"""Out-of-memory recoveries made visible (issue 57 item 2): a run's ``trainer/oom_recovery``
records are counted in its summary and in Compare, its calibration is refused with the reason,
and the next plan of its family on its card is capped at the limits it went on with. The runs'
telemetry is written into the app's real store as the tailer would (records of the fixed format
of docs/contracts.md), on the app in-process (``api``)."""

from __future__ import annotations

import json

import pytest

from workbench.services.calibration import Calibrator, recovery_for
from workbench.store import Store
from workbench.worker.preset import load_preset

RTX4090 = {"device": "cuda:0", "device_name": "NVIDIA GeForce RTX 4090"}
H100 = {"device": "cuda:0", "device_name": "NVIDIA H100 80GB HBM3"}
BEFORE = {
    "vram_high_watermark_mb": 1.0,
    "vram_low_watermark_mb": 0.5,
    "activation_vram_high_watermark_mb": 0.5,
}
AFTER = {
    "vram_high_watermark_mb": 0.6,
    "vram_low_watermark_mb": 0.3,
    "activation_vram_high_watermark_mb": 0.25,
}
"""tiny-ci's limits and what a recovery at step 3 lowered them to (MB)."""


def recovery(step: int, after: dict, phase: str = "backward") -> dict:
    return {
        "phase": phase,
        "attempt": 1,
        "failure_bytes": 23_900_000_000,
        "card_bytes": 25_757_220_864,
        "limits_before": BEFORE,
        "limits_after": after,
        "message": "CUDA out of memory. Tried to allocate 2.00 GiB",
        "_step": step,
    }


def record_run(
    store: Store, config: dict, started: dict, recoveries: list[dict], steps: int = 4
) -> int:
    """A finished run of ``steps`` steps with ``recoveries`` (``recovery()``) as the worker
    writes them: the record at the failed step, then the rerun's ``limits_applied`` (request
    ``oom``) and the step's record; ``run_finished`` counts them."""
    run_id = store.create_run("r", "tiny-ci", config, "default")
    records = [
        ("trainer", "run_started", None, {"max_steps": steps, **started}),
        ("trainer", "stage", None, {"stage": "train", "done": 0, "total": steps}),
    ]
    for step in range(1, steps + 1):
        for rec in (r for r in recoveries if r["_step"] == step):
            fields = {k: v for k, v in rec.items() if k != "_step"}
            records.append(("trainer", "oom_recovery", step, fields))
            changed = {f: [rec["limits_before"][f], v] for f, v in rec["limits_after"].items()}
            records.append(
                ("strategy", "limits_applied", step, {"request_id": "oom", "changed": changed})
            )
        fields = {"loss": 1.0, "vram_peak_mb": 1.5, "step_time_ms": 0.4}
        records.append(("trainer", "step", step, fields))
    finished = {"status": "succeeded", "steps_done": steps, "recoveries": len(recoveries)}
    records.append(("trainer", "run_finished", steps, finished))
    rows = []
    for seq, (source, kind, step, fields) in enumerate(records):
        rec = {"seq": seq, "time": 100.0 + seq * 0.01, "source": source, "kind": kind}
        rec.update({"step": step, "phase": None, **fields})
        rows.append((seq, rec["time"], source, kind, step, rec["phase"], json.dumps(rec)))
    store.ingest(run_id, rows, 1000)
    store.update_run(run_id, status="succeeded", summary=store.summary(run_id))
    return run_id


@pytest.fixture
def store(api) -> Store:
    return api.app.state.store


def test_summary_and_compare_count_recoveries(store, api):
    _, config = load_preset("tiny-ci")
    twice = record_run(store, config, RTX4090, [recovery(2, AFTER), recovery(3, AFTER)])
    never = record_run(store, config, RTX4090, [])
    assert store.summary(twice)["recoveries"] == 2
    assert store.summary(never)["recoveries"] == 0
    assert api.get(f"/api/runs/{twice}").json()["summary"]["recoveries"] == 2
    assert api.get(f"/api/runs/{never}").json()["summary"]["recoveries"] == 0

    out = api.get(f"/api/compare?ids={twice},{never}").json()
    assert [(s["run_id"], s["recoveries"]) for s in out["summary"]] == [(twice, 2), (never, 0)]
    # The run's limits in force: the recovery's change, made by the run (request "oom").
    limits = api.get(f"/api/runs/{twice}/limits").json()
    assert [h["request_id"] for h in limits["history"]] == ["oom", "oom"]
    assert limits["now"]["vram_high_watermark_mb"] == 0.6

    # Its peak and step time mix two configs: not calibrated, and the reason says why.
    assert Calibrator(store).calibrate(twice) is None
    reason = api.get(f"/api/runs/{twice}/calibration").json()["error"]["message"]
    assert "ran out of memory and lowered its limits (step 2)" in reason


def test_next_plan_of_the_family_on_the_card_is_capped(store, api):
    _, config = load_preset("tiny-ci")
    body = {"preset": config, "device": "rtx4090"}
    before = api.post("/api/plan", json=body).json()
    assert "recovery" not in before
    assert before["memory"]["stagehand"]["vram_high_watermark_mb"] == 1.0

    # Runs that teach nothing here: another card, and a run that never ran out of memory.
    record_run(store, config, H100, [recovery(2, {"vram_high_watermark_mb": 0.1})])
    record_run(store, config, RTX4090, [])
    assert "recovery" not in api.post("/api/plan", json=body).json()

    taught = record_run(store, config, RTX4090, [recovery(3, AFTER)])
    out = api.post("/api/plan", json=body).json()
    sh = out["memory"]["stagehand"]
    assert (sh["vram_high_watermark_mb"], sh["vram_low_watermark_mb"]) == (0.6, 0.3)
    assert sh["activation_stagehand"]["vram_high_watermark_mb"] == 0.25
    assert sh["activation_stagehand"]["vram_low_watermark_mb"] == 0.25  # kept under its high
    rec = out["recovery"]
    assert rec["run_ids"] == [taught] and rec["limits"] == AFTER
    assert rec["capped"] == {
        "vram_high_watermark_mb": [1.0, 0.6],
        "vram_low_watermark_mb": [0.5, 0.3],
        "activation_vram_high_watermark_mb": [0.5, 0.25],
    }
    assert rec["recoveries"][0] | {"run_id": taught} == {
        "run_id": taught,
        "step": 3,
        "phase": "backward",
        "attempt": 1,
        "failure_bytes": 23_900_000_000,
        "card_bytes": 25_757_220_864,
    }
    assert rec["note"] == (
        f"a past run (#{taught}) ran out of memory on rtx4090/flux (at step 3, backward); limits"
        " capped at what it went on with: vram_high_watermark_mb 1 → 0.6,"
        " vram_low_watermark_mb 0.5 → 0.3, activation_vram_high_watermark_mb 0.5 → 0.25"
    )
    # The capped preset is what was planned: the same plan as a preset with those limits.
    capped = json.loads(json.dumps(config))
    capped["memory"]["stagehand"].update(vram_high_watermark_mb=0.6, vram_low_watermark_mb=0.3)
    act = capped["memory"]["stagehand"]["activation_stagehand"]
    act.update(vram_high_watermark_mb=0.25, vram_low_watermark_mb=0.25)
    same = api.post("/api/plan", json={**body, "preset": capped}).json()
    assert out["peak_bytes"] == same["peak_bytes"] and out["step_ms"] == same["step_ms"]
    assert same["recovery"]["capped"] == {}  # already at the limits learnt
    # Another card, another family: planned as modelled.
    assert "recovery" not in api.post("/api/plan", json={**body, "device": "h100-pcie"}).json()
    assert recovery_for(store, "rtx4090", "sdxl") is None


def test_plan_takes_the_lowest_limits_of_the_newest_runs(store, api):
    _, config = load_preset("tiny-ci")
    old = record_run(store, config, RTX4090, [recovery(2, {"vram_high_watermark_mb": 0.4})])
    new = record_run(store, config, RTX4090, [recovery(1, AFTER, phase="forward")])
    learnt = recovery_for(store, "rtx4090", "flux")
    assert learnt["run_ids"] == [new, old]
    assert learnt["limits"] == {**AFTER, "vram_high_watermark_mb": 0.4}
    assert learnt["taught_by"]["vram_high_watermark_mb"] == old
    out = api.post("/api/plan", json={"preset": config, "device": "rtx4090"}).json()
    assert out["memory"]["stagehand"]["vram_high_watermark_mb"] == 0.4
    assert out["recovery"]["note"].startswith(
        f"past runs (#{new}, #{old}) ran out of memory on rtx4090/flux (#{new} at step 1,"
        f" forward; #{old} at step 2, backward); limits capped at the lowest they went on with:"
    )


def test_workbench_plan_caps_the_limits_as_the_api_does(store, api, tmp_path, capsys):
    """``workbench plan --data-dir DIR`` reads the recoveries of the server's database as
    ``POST /api/plan`` does: the same capped plan, its ``recovery`` entry in ``--json`` and the
    note on stderr; ``--no-calibration`` plans the preset as given."""
    from workbench.cli.plan import main as plan_main

    _, config = load_preset("tiny-ci")
    taught = record_run(store, config, RTX4090, [recovery(3, AFTER)])
    served = api.post("/api/plan", json={"preset": config, "device": "rtx4090"}).json()
    data_dir = store.path.parent
    out = tmp_path / "plan.json"
    argv = ["tiny-ci", "--device", "rtx4090", "--data-dir", str(data_dir), "--json", str(out)]
    assert plan_main(argv) in (0, 1)
    cli = json.loads(out.read_text())
    assert cli["recovery"]["run_ids"] == [taught]
    assert cli["recovery"]["capped"] == served["recovery"]["capped"]
    assert cli["memory"] == served["memory"] and cli["peak_bytes"] == served["peak_bytes"]
    assert f"a past run (#{taught}) ran out of memory" in capsys.readouterr().err
    assert plan_main([*argv, "--no-calibration"]) in (0, 1)
    plain = json.loads(out.read_text())
    assert "recovery" not in plain
    assert plain["memory"]["stagehand"]["vram_high_watermark_mb"] == 1.0

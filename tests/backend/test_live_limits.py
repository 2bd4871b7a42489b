"""Live limits against the limits in force, over stored records.

``PATCH /api/runs/{id}/limits`` checks a body against the run's effective limits (its config
folded with the ``strategy/limits_applied`` records), ``GET /api/runs/{id}/limits`` gives
them with their history, and Compare's config diff shows the changes made during the run.

The app runs in-process over an ``IdleExecutor``: the supervisor starts its runs as jobs
without a worker, and the test plays each worker by appending its records to the run's
``telemetry.jsonl`` (the real tailer stores them) and ending its job. A real worker applying
limits and acknowledging them is ``test_lifecycle.test_queue_cancel_and_live_limits``.
"""

from __future__ import annotations

import json
import time

from backend_helpers import assert_error_body, stored_records, wait_for, wait_status
from inprocess import IdleExecutor, append_records

from workbench.services.limits import config_limits


class PlayedWorker:
    """Writes a run's records with consecutive ``seq``s, as ``stagehand.common.telemetry`` does,
    and reads the control requests the server drops into ``DIR/control``."""

    def __init__(self, data_dir, run_id: int) -> None:
        self.data_dir, self.run_id, self.seq = data_dir, run_id, 0

    def emit(self, source: str, kind: str, step: int | None, **fields) -> dict:
        record = {"seq": self.seq, "time": time.time(), "source": source, "kind": kind}
        record.update(step=step, phase=None, **fields)
        append_records(self.data_dir, self.run_id, [record])
        self.seq += 1
        return record

    def requests(self) -> list[dict]:
        control = self.data_dir / "runs" / str(self.run_id) / "control"
        return [json.loads(p.read_text()) for p in sorted(control.glob("*.json"))]


def test_config_limits_are_those_of_the_runtimes_that_are_on():
    # The runtime's defaults where the config says nothing; None: derived by the runtime at
    # the run's start from its blocks and device (runtime/stagehand/weights/defaults.py).
    assert config_limits({}) == {
        "vram_high_watermark_mb": 20000,
        "vram_low_watermark_mb": 16000,
        "prefetch_window_blocks": None,
        "max_inflight_transfers": None,
    }
    spill_only = {
        "memory": {
            "stagehand": {"weight_streaming": False, "activation_stagehand": {"enabled": True}}
        }
    }
    assert config_limits(spill_only) == {
        "activation_vram_high_watermark_mb": 20000,
        "activation_vram_low_watermark_mb": 16000,
        "max_inflight_d2h": 1,
        "max_inflight_h2d": 1,
    }
    assert config_limits({"memory": {"strategy": "none"}}) == {}


def test_limits_checked_against_those_in_force_and_listed_with_their_history(api_factory):
    executor = IdleExecutor(slots=1)  # one run at a time: the second waits for the first
    client = api_factory(executor=executor)
    data_dir = client.app.state.settings.data_dir
    resp = client.post("/api/runs", json={"preset": "tiny-ci", "overrides": {"max_steps": 100000}})
    run_id = resp.json()["id"]
    other = client.post("/api/runs", json={"preset": "tiny-ci", "overrides": {"max_steps": 1}})
    other_id = other.json()["id"]
    url = f"/api/runs/{run_id}/limits"
    # tiny-ci: weights 1.0/0.5 MB, spill 0.5/0.25 MB.
    start = client.get(url).json()
    assert start["preset"] == start["now"]
    assert start["now"]["vram_low_watermark_mb"] == 0.5
    assert start["now"]["activation_vram_high_watermark_mb"] == 0.5
    assert start["paths"]["activation_vram_low_watermark_mb"] == (
        "memory.stagehand.activation_stagehand.vram_low_watermark_mb"
    )
    assert start["history"] == []
    # The same table without a run, for the New run form (the dashboard has none).
    fields = client.get("/api/limits/fields").json()
    assert fields == {"paths": start["paths"], "pairs": start["pairs"]}
    assert fields["pairs"] == [
        ["vram_high_watermark_mb", "vram_low_watermark_mb"],
        ["activation_vram_high_watermark_mb", "activation_vram_low_watermark_mb"],
    ]
    assert len(fields["paths"]) == 8
    wait_status(client, run_id, "running")
    assert client.get(f"/api/runs/{other_id}").json()["status"] == "queued"
    worker = PlayedWorker(data_dir, run_id)
    worker.emit("trainer", "run_started", None, max_steps=100000)

    # One side of a pair, against the other side in force: 422 naming the field given.
    err = assert_error_body(client.patch(url, json={"vram_high_watermark_mb": 0.25}), 422)
    assert err["field"] == "vram_high_watermark_mb"
    assert err["message"] == (
        "vram_high_watermark_mb (0.25) must not be below the low watermark in force, "
        "vram_low_watermark_mb (0.5)"
    )
    err = assert_error_body(client.patch(url, json={"activation_vram_low_watermark_mb": 0.75}), 422)
    assert err["field"] == "activation_vram_low_watermark_mb"
    assert err["message"] == (
        "activation_vram_low_watermark_mb (0.75) must not be above the high watermark in "
        "force, activation_vram_high_watermark_mb (0.5)"
    )

    # Applied changes move the limits in force: the same body is then refused or accepted.
    # (A real worker refuses limits before its first step: it has no strategy yet.)
    worker.emit("trainer", "step", 1, loss=1.0, step_time_ms=100.0)
    wait_for(
        lambda: any(r["kind"] == "step" for r in stored_records(client, run_id)),
        120,
        0.2,
        "a first step",
    )
    resp = client.patch(url, json={"vram_low_watermark_mb": 0.125})
    assert resp.status_code == 202, resp.text
    request_id = resp.json()["request_id"]
    # The request reached the worker's control folder; the worker applies it at step 2.
    (sent,) = worker.requests()
    assert sent == {
        "command": "limits",
        "limits": {"vram_low_watermark_mb": 0.125},
        "request_id": request_id,
    }
    worker.emit("trainer", "step", 2, loss=0.9, step_time_ms=100.0)
    worker.emit(
        "strategy",
        "limits_applied",
        2,
        request_id=request_id,
        changed={"vram_low_watermark_mb": [0.5, 0.125]},
    )
    applied = wait_for(
        lambda: [
            r
            for r in stored_records(client, run_id)
            if r["kind"] == "limits_applied" and r["request_id"] == request_id
        ],
        60,
        0.2,
        "the worker applying vram_low_watermark_mb 0.125",
    )[0]
    resp = client.patch(url, json={"vram_high_watermark_mb": 0.25})
    assert resp.status_code == 202, resp.text
    high_id = resp.json()["request_id"]
    err = assert_error_body(client.patch(url, json={"vram_high_watermark_mb": 0.0625}), 422)
    assert err["message"].endswith("in force, vram_low_watermark_mb (0.125)")

    limits = client.get(url).json()
    assert limits["history"][0] == {
        "seq": applied["seq"],
        "step": applied["step"],
        "time": applied["time"],
        "request_id": request_id,
        "changed": {"vram_low_watermark_mb": [0.5, 0.125]},
    }
    assert limits["preset"]["vram_low_watermark_mb"] == 0.5
    assert limits["now"]["vram_low_watermark_mb"] == 0.125
    # The worker applies the high watermark at step 3, then stops when asked to.
    worker.emit("trainer", "step", 3, loss=0.8, step_time_ms=100.0)
    worker.emit(
        "strategy",
        "limits_applied",
        3,
        request_id=high_id,
        changed={"vram_high_watermark_mb": [1.0, 0.25]},
    )
    client.post(f"/api/runs/{run_id}/cancel")
    assert worker.requests()[-1]["command"] == "stop"
    worker.emit("trainer", "run_finished", 3, status="cancelled", steps_done=3)
    executor.end(run_id, 0)
    wait_status(client, run_id, "cancelled")
    # Then the queued run starts, takes its one step and succeeds.
    wait_status(client, other_id, "running")
    second = PlayedWorker(data_dir, other_id)
    second.emit("trainer", "run_started", None, max_steps=1)
    second.emit("trainer", "step", 1, loss=1.0, step_time_ms=100.0)
    second.emit("trainer", "run_finished", 1, status="succeeded", steps_done=1)
    executor.end(other_id, 0)
    wait_status(client, other_id, {"succeeded"})

    # Compare: the config's value and, for the run that changed it, each change with its step.
    limits = client.get(url).json()
    assert [h["request_id"] for h in limits["history"]] == [request_id, high_id]
    high = limits["history"][-1]
    cmp = client.get("/api/compare", params={"ids": f"{run_id},{other_id}"}).json()
    rows = {d["path"]: d for d in cmp["config_diff"]}
    low = rows["memory.stagehand.vram_low_watermark_mb"]
    assert low["values"] == {str(run_id): 0.5, str(other_id): 0.5}
    assert low["live"] == {str(run_id): [[applied["step"], 0.125]]}
    assert rows["memory.stagehand.vram_high_watermark_mb"]["live"] == {
        str(run_id): [[high["step"], 0.25]]
    }
    assert "live" not in rows["max_steps"]


def test_limits_of_a_run_with_auto_watermarks_and_derived_window(api_factory):
    # As every 24 GB family preset: "auto" watermarks and no prefetch window or copies in
    # flight (derived at start). GET answered 500 (ResponseValidationError) on the None
    # values and on the worker's ["auto", MB] change.
    executor = IdleExecutor(slots=1)
    client = api_factory(executor=executor)
    data_dir = client.app.state.settings.data_dir
    stagehand = {
        "vram_high_watermark_mb": "auto",
        "vram_low_watermark_mb": "auto",
        "prefetch_window_blocks": None,
        "max_inflight_transfers": None,
    }
    body = {"preset": "tiny-ci", "overrides": {"memory": {"stagehand": stagehand}}}
    run_id = client.post("/api/runs", json=body).json()["id"]
    url = f"/api/runs/{run_id}/limits"
    start = client.get(url)
    assert start.status_code == 200, start.text
    assert start.json()["now"]["prefetch_window_blocks"] is None
    assert "vram_high_watermark_mb" not in start.json()["now"]
    wait_status(client, run_id, "running")
    worker = PlayedWorker(data_dir, run_id)
    worker.emit("trainer", "run_started", None, max_steps=8)
    marks = {"vram_high_watermark_mb": ["auto", 2.5], "vram_low_watermark_mb": ["auto", 1.75]}
    worker.emit("strategy", "limits_applied", None, request_id="auto", changed=marks)
    wait_for(
        lambda: any(r["kind"] == "limits_applied" for r in stored_records(client, run_id)),
        60,
        0.2,
        "the worker resolving auto",
    )
    limits = client.get(url)
    assert limits.status_code == 200, limits.text
    assert limits.json()["now"]["vram_high_watermark_mb"] == 2.5
    assert limits.json()["history"][0]["changed"] == marks
    client.post(f"/api/runs/{run_id}/cancel")
    worker.emit("trainer", "run_finished", None, status="cancelled", steps_done=0)
    executor.end(run_id, 0)
    wait_status(client, run_id, "cancelled")

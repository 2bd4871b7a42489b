"""A tiny-ci run through the API, followed over the websocket; reconnect with ``since``.

The app in-process over the real local executor (``local_api``: a real ``workbench train``
worker, forked); the websocket over a real server's uvicorn is the dashboard tests' (and
``test_security``'s)."""

from __future__ import annotations

import json
import threading

from backend_helpers import file_records, stored_records, wait_status
from inprocess import ws_url

from workbench.contract.status import TERMINAL


def follow(ws, stop_after_step: bool = False):
    """Frames until a terminal run frame (or the first step record); ``(records, runs)``."""
    records, runs = [], []
    while True:
        frame = json.loads(ws.receive_text())
        assert set(frame) <= {"records", "run"}, frame
        records += frame.get("records", [])
        if "run" in frame:
            runs.append(frame["run"])
            if frame["run"]["status"] in TERMINAL:
                return records, runs
        if stop_after_step and any(r["kind"] == "step" for r in records):
            return records, runs


def following(client, run_id: int, since: int = -1, **kw) -> dict:
    """``follow`` on a websocket of its own from ``since``, in a thread (the in-process
    websocket's receive has no timeout): ``out["records"], out["runs"]`` once it ended."""
    out: dict = {}

    def run() -> None:
        path = f"/api/runs/{run_id}/stream?since={since}"
        with client.websocket_connect(ws_url(client, path)) as ws:
            out["records"], out["runs"] = follow(ws, **kw)

    out["thread"] = thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return out


def ended(out: dict, timeout: float = 200) -> tuple[list, list]:
    out["thread"].join(timeout)
    assert not out["thread"].is_alive() and "runs" in out, "the websocket follow did not end"
    return out["records"], out["runs"]


def test_follow_to_completion_and_reconnect_with_since(local_api, tmp_path):
    client = local_api()
    data_dir = tmp_path / "data"
    resp = client.post("/api/runs", json={"preset": "tiny-ci", "overrides": {"max_steps": 12}})
    assert resp.status_code == 201, resp.text
    run = resp.json()
    assert run["status"] in ("queued", "running") and run["config"]["max_steps"] == 12
    run_id = run["id"]

    whole = following(client, run_id)

    # A second client disconnects after its first step record and comes back with `since`.
    first, _ = ended(following(client, run_id, stop_after_step=True), 180)
    last_seq = first[-1]["seq"]
    rest, runs = ended(following(client, run_id, since=last_seq), 180)
    whole["records"], whole["runs"] = ended(whole)

    final = wait_status(client, run_id, TERMINAL)
    assert final["status"] == "succeeded", final
    assert runs[-1]["status"] == "succeeded"
    in_file = file_records(data_dir, run_id)
    assert in_file[-1]["kind"] == "run_finished"
    assert [r["seq"] for r in in_file] == list(range(len(in_file)))
    # Every client saw exactly the file: line for line, no loss, no duplicates.
    assert whole["records"] == in_file
    assert first + rest == in_file
    assert rest and rest[0]["seq"] == last_seq + 1
    assert stored_records(client, run_id) == in_file
    assert final["last_seq"] == in_file[-1]["seq"]

    steps = [r for r in in_file if r["source"] == "trainer" and r["kind"] == "step"]
    summary = final["summary"]
    assert summary["steps_done"] == 12 and summary["max_steps"] == 12
    assert summary["final_loss"] == steps[-1]["loss"]
    mean = sum(r["step_time_ms"] for r in steps) / len(steps)
    assert abs(summary["mean_step_time_ms"] - mean) < 1e-6 * mean

    # Paging and min/max buckets over the stored records.
    page = client.get(f"/api/runs/{run_id}/telemetry", params={"since": 3, "limit": 5}).json()
    assert [r["seq"] for r in page["data"]] == [4, 5, 6, 7, 8]
    assert page["next_since"] == 8 and page["count"] == 5
    buckets = client.get(
        f"/api/runs/{run_id}/telemetry",
        params={"source": "trainer", "kind": "step", "buckets": 3},
    ).json()["data"]
    assert len(buckets) == 3 and sum(b["count"] for b in buckets) == 12
    assert max(b["max"]["loss"] for b in buckets) == max(r["loss"] for r in steps)
    assert min(b["min"]["loss"] for b in buckets) == min(r["loss"] for r in steps)
    assert "phase_ms.forward" in buckets[0]["max"] or "step_time_ms" in buckets[0]["max"]
    # Only the fields asked for, with the same figures.
    named = client.get(
        f"/api/runs/{run_id}/telemetry",
        params={"source": "trainer", "kind": "step", "buckets": 3, "fields": "loss,nope"},
    ).json()["data"]
    assert [b["max"] for b in named] == [{"loss": b["max"]["loss"]} for b in buckets]
    assert [b["count"] for b in named] == [b["count"] for b in buckets]

    # The finished run's files: config written for the worker, log captured, no sample listed.
    run_dir = data_dir / "runs" / str(run_id)
    assert (run_dir / "worker.log").stat().st_size > 0
    listed = client.get(f"/api/runs/{run_id}/artifacts").json()
    assert listed == {"data": [], "count": 0}

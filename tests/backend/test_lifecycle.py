"""Worker exits and the statuses they give; the queue; cancel; live limits; server restarts.

Real ``workbench train`` workers, but for a server killed and restarted: there the server's own
process is the point (``server_factory``) and its workers are the synthetic worker of the
dashboard tests, which writes a run's telemetry as the trainer does (``tests/backend/test_ray.py``
kills a Ray server under it too; a forked worker adopted by a restarted server:
``test_forkserver.py``). A worker outlives its server because it runs in a session of its own
with its output in a file, whatever it runs. The app runs in this process elsewhere
(``local_api``: its workers forked from the test process's fork server)."""

from __future__ import annotations

import os
import signal
import time

from backend_helpers import (
    assert_error_body,
    file_records,
    stored_records,
    wait_for,
    wait_status,
)

from workbench.contract.status import TERMINAL

LONG = {"max_steps": 100000}
"""A run that only ends when it is stopped (steps of tiny-ci take ~0.1 s)."""


def create(client, overrides=None, **body):
    resp = client.post(
        "/api/runs", json={"preset": "tiny-ci", "overrides": overrides or {}, **body}
    )
    assert resp.status_code == 201, resp.text
    return resp.json()["id"]


def steps_stored(client, run_id) -> int:
    page = client.get(
        f"/api/runs/{run_id}/telemetry", params={"source": "trainer", "kind": "step"}
    ).json()
    return page["count"]


def wait_steps(client, run_id, n=2):
    wait_for(lambda: steps_stored(client, run_id) >= n, 180, 0.2, f"{n} steps of run {run_id}")


def test_stall_sigkill_gives_killed_and_a_failing_worker_gives_failed(local_api, tmp_path):
    # Stalled after 2 s without telemetry (the default is 20 x the median step, at least 60 s).
    client = local_api(max_parallel=2, stall_min_s=2, stall_factor=1)
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    bad = create(client, {"model": {"factory": None, "path": str(empty)}})
    long = create(client, LONG)

    failed = wait_status(client, bad, TERMINAL)
    assert failed["status"] == "failed" and failed["exit_code"] == 1, failed
    last = file_records(tmp_path / "data", bad)[-1]
    assert last["kind"] == "error"
    assert failed["error"]["message"] == last["message"]
    assert failed["error"]["error_type"] == last["error_type"]
    assert failed["error"]["traceback"] == last["traceback"] and "Traceback" in last["traceback"]

    wait_steps(client, long)
    pid = client.get(f"/api/runs/{long}").json()["pid"]
    os.kill(pid, signal.SIGSTOP)  # alive but silent
    try:
        wait_status(client, long, "stalled", timeout=60)
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_status(client, long, "running", timeout=60)
    os.kill(pid, signal.SIGKILL)
    killed = wait_status(client, long, TERMINAL)
    assert killed["status"] == "killed" and killed["signal"] == "SIGKILL", killed
    assert killed["exit_code"] == -9 and "SIGKILL" in killed["error"]["message"]
    assert stored_records(client, long) == file_records(tmp_path / "data", long)
    assert killed["summary"]["steps_done"] >= 2

    # Ended runs cannot be cancelled or given limits; they can be deleted with their files.
    assert_error_body(client.post(f"/api/runs/{long}/cancel"), 409)
    assert_error_body(
        client.patch(f"/api/runs/{long}/limits", json={"prefetch_window_blocks": 1}), 409
    )
    assert client.delete(f"/api/runs/{bad}").status_code == 204
    assert not (tmp_path / "data" / "runs" / str(bad)).exists()
    assert_error_body(client.get(f"/api/runs/{bad}"), 404)
    assert client.get(f"/api/runs/{bad}/telemetry").status_code == 404


def test_queue_cancel_and_live_limits(local_api, tmp_path):
    client = local_api()
    data_dir = tmp_path / "data"
    first = create(client, LONG, name="first")
    second = create(client, {"max_steps": 3}, name="second")
    third = create(client, {"max_steps": 3}, name="third")
    runs = {r["id"]: r for r in client.get("/api/runs").json()["data"]}
    assert runs[first]["status"] == "running"
    assert runs[second]["status"] == runs[third]["status"] == "queued"
    listed = client.get("/api/runs", params={"status": "queued"}).json()
    assert sorted(r["id"] for r in listed["data"]) == [second, third] and listed["count"] == 2

    # A queued run is cancelled at once and never starts.
    resp = client.post(f"/api/runs/{third}/cancel")
    assert resp.status_code == 200 and resp.json()["status"] == "cancelled"
    assert resp.json()["pid"] is None

    # Limits: validated (422 naming the field), 409 unless running, acknowledged by the worker.
    err = assert_error_body(
        client.patch(f"/api/runs/{first}/limits", json={"vram_high_watermark_mb": -5}), 422
    )
    assert err["field"] == "vram_high_watermark_mb"
    err = assert_error_body(client.patch(f"/api/runs/{first}/limits", json={"bogus": 1}), 422)
    assert err["field"] == "bogus"
    err = assert_error_body(
        client.patch(
            f"/api/runs/{first}/limits",
            json={"vram_high_watermark_mb": 100, "vram_low_watermark_mb": 200},
        ),
        422,
    )
    assert "vram_low_watermark_mb" in err["message"]
    assert_error_body(client.patch(f"/api/runs/{first}/limits", json={}), 422)
    assert_error_body(
        client.patch(f"/api/runs/{second}/limits", json={"prefetch_window_blocks": 1}), 409
    )
    wait_steps(client, first)
    resp = client.patch(
        f"/api/runs/{first}/limits",
        json={"vram_high_watermark_mb": 1234, "vram_low_watermark_mb": 1000},
    )
    assert resp.status_code == 202, resp.text
    request_id = resp.json()["request_id"]

    def ack():
        recs = stored_records(client, first)
        return [r for r in recs if r["kind"] == "limits_applied" and r["request_id"] == request_id]

    acks = wait_for(ack, 120, 0.2, "limits_applied acknowledgement")
    assert len(acks) == 1 and acks[0]["source"] == "strategy"
    assert acks[0]["changed"]["vram_high_watermark_mb"][1] == 1234, acks[0]
    # tiny-ci streams its blocks (memory.strategy "stagehand"): the weight runtime's step
    # records after the acknowledgement carry the new watermarks.
    later = wait_for(
        lambda: [
            r
            for r in stored_records(client, first)
            if r["source"] == "stagehand" and r["kind"] == "step" and r["seq"] > acks[0]["seq"]
        ],
        120,
        0.2,
        "a stagehand step record after the acknowledgement",
    )
    assert all(r["vram_high_watermark_mb"] == 1234 for r in later), later[0]
    assert all(r["vram_low_watermark_mb"] == 1000 for r in later)

    # Notes and tags.
    resp = client.patch(f"/api/runs/{first}", json={"notes": "baseline", "tags": ["a", "b"]})
    assert resp.json()["notes"] == "baseline" and resp.json()["tags"] == ["a", "b"]
    tagged = client.get("/api/runs", params={"tag": "b"}).json()
    assert [r["id"] for r in tagged["data"]] == [first]

    # Cancelling the running run lets the queued one start, after it.
    assert client.post(f"/api/runs/{first}/cancel").status_code == 200
    done_first = wait_status(client, first, TERMINAL)
    assert done_first["status"] == "cancelled" and done_first["exit_code"] == 0, done_first
    assert file_records(data_dir, first)[-1]["status"] == "cancelled"
    done_second = wait_status(client, second, TERMINAL)
    assert done_second["status"] == "succeeded", done_second
    assert done_second["started_at"] >= done_first["finished_at"]
    assert client.get(f"/api/runs/{third}").json()["status"] == "cancelled"
    assert not (data_dir / "runs" / str(third) / "telemetry.jsonl").exists()

    # Compare the two that ran: aligned series, the config fields that differ or that a run
    # changed while it ran (the config's value, then each change and its step), summary table.
    cmp = client.get("/api/compare", params={"ids": f"{first},{second}", "metrics": "loss"}).json()
    assert set(cmp["series"]["loss"]) == {str(first), str(second)}
    assert len(cmp["series"]["loss"][str(second)]) == 3
    assert [d["path"] for d in cmp["config_diff"]] == [
        "max_steps",
        "memory.stagehand.vram_high_watermark_mb",
        "memory.stagehand.vram_low_watermark_mb",
    ]
    assert cmp["config_diff"][0]["values"] == {str(first): 100000, str(second): 3}
    high = cmp["config_diff"][1]
    assert high["values"] == {str(first): 1.0, str(second): 1.0}
    assert high["live"] == {str(first): [[acks[0]["step"], 1234]]}
    assert [s["run_id"] for s in cmp["summary"]] == [first, second]


SYNTHETIC = {"STAGEHAND_WORKBENCH_WORKER_MODULE": "tests.frontend.synthetic_worker"}
"""Workers that write a run's telemetry as the trainer does (docs/contracts.md) without torch:
~0.1 CPU-s to start and a step of sleep, where a tiny-ci worker takes ~5 CPU-s of imports and
then a core for as long as it runs."""


def test_server_restart_reconciles_without_losing_telemetry(server_factory):
    srv = server_factory(args=("--max-parallel", "2"), env=SYNTHETIC).start()
    client = srv.client()
    adopted, crashed = create(client, LONG), create(client, LONG)
    wait_steps(client, adopted)
    wait_steps(client, crashed)
    pids = {i: client.get(f"/api/runs/{i}").json()["pid"] for i in (adopted, crashed)}

    srv.stop(signal.SIGKILL)  # the server dies; its workers live on in their own sessions
    os.kill(pids[crashed], signal.SIGKILL)  # ...and one of them dies while nobody watches
    time.sleep(1.0)  # the survivor keeps writing telemetry that nobody ingests yet

    srv2 = server_factory(args=("--max-parallel", "2"), env=SYNTHETIC).start()
    client = srv2.client()
    gone = client.get(f"/api/runs/{crashed}").json()
    assert gone["status"] == "crashed", gone
    last = file_records(srv2.data_dir, crashed)[-1]
    assert f"seq {last['seq']}" in gone["error"]["message"]
    assert gone["error"]["last_record"] == last
    assert stored_records(client, crashed) == file_records(srv2.data_dir, crashed)

    alive = client.get(f"/api/runs/{adopted}").json()
    assert alive["status"] == "running" and alive["pid"] == pids[adopted]
    before = alive["last_seq"]
    wait_for(lambda: client.get(f"/api/runs/{adopted}").json()["last_seq"] > before + 2, 120)
    assert client.post(f"/api/runs/{adopted}/cancel").status_code == 200
    final = wait_status(client, adopted, TERMINAL)
    assert final["status"] == "cancelled", final
    stored, in_file = stored_records(client, adopted), file_records(srv2.data_dir, adopted)
    assert stored == in_file
    assert [r["seq"] for r in stored] == list(range(len(in_file)))


def test_outputs_download_and_resume_from_a_checkpoint(local_api, tmp_path):
    """A run stopped before its end lists its checkpoints, resumes from the last as the same
    run (telemetry continuing its seq), finishes, and its LoRA downloads as safetensors."""
    from safetensors.torch import load

    client = local_api()
    data_dir = tmp_path / "data"
    run_id = create(client, {"max_steps": 400, "checkpoint_every": 4}, name="resumable")
    run_dir = data_dir / "runs" / str(run_id)
    wait_for(lambda: (run_dir / "checkpoints" / "step-8").is_dir(), 180, 0.2, "checkpoint 8")
    err = assert_error_body(client.post(f"/api/runs/{run_id}/resume"), 409)
    assert err["field"] == "id" and "running" in err["message"]
    assert client.post(f"/api/runs/{run_id}/cancel").status_code == 200
    assert wait_status(client, run_id, TERMINAL)["status"] == "cancelled"
    outputs = client.get(f"/api/runs/{run_id}/outputs").json()
    assert outputs["resumable"] and outputs["checkpoints"][-1]["step"] >= 8
    assert all(c["size"] > 0 for c in outputs["checkpoints"])
    last = outputs["checkpoints"][-1]["step"]
    stopped_at = stored_records(client, run_id)[-1]["seq"]

    # A worker killed mid-write leaves half a line: the resumed worker's first
    # record must not be glued to it (that seq was lost from the file and the store).
    with open(run_dir / "telemetry.jsonl", "a") as f:
        f.write(f'{{"seq": {stopped_at + 1}, "time": 1.0, "sour')

    # Resumed with fewer steps left: the same run, queued, then running from its checkpoint.
    config = run_dir / "config.json"
    config.write_text(config.read_text().replace('"max_steps": 400', f'"max_steps": {last + 3}'))
    resumed = client.post(f"/api/runs/{run_id}/resume").json()
    assert resumed["id"] == run_id and resumed["status"] in ("queued", "running")
    done = wait_status(client, run_id, ["succeeded", "failed", "crashed", "killed"])
    assert done["status"] == "succeeded", done
    records = stored_records(client, run_id)
    seqs = [r["seq"] for r in records]
    assert seqs == list(range(len(seqs))) and seqs[-1] > stopped_at  # one stream, no gap
    assert records == file_records(data_dir, run_id)
    stages = [r for r in records if r["kind"] == "stage" and r["seq"] > stopped_at]
    assert any(r["stage"] == "train" and r["done"] == last for r in stages), stages[:3]
    trainer = [r for r in records if r["source"] == "trainer" and r["kind"] == "step"]
    after = [r["step"] for r in trainer if r["seq"] > stopped_at]
    assert after == [last + 1, last + 2, last + 3]  # continued from the checkpoint
    assert_error_body(client.post(f"/api/runs/{run_id}/resume"), 409)  # succeeded: nothing left

    lora = client.get(f"/api/runs/{run_id}/outputs").json()["lora"]
    assert [f["name"] for f in lora] == ["pytorch_lora_weights.safetensors"]
    got = client.get(lora[0]["url"])
    assert got.status_code == 200 and "attachment" in got.headers["content-disposition"]
    weights = load(got.content)
    assert weights and all(k.endswith(("lora_A.weight", "lora_B.weight")) for k in weights)
    assert_error_body(client.get(f"/api/runs/{run_id}/lora/..secret"), 422)
    assert_error_body(client.get(f"/api/runs/{run_id}/lora/missing.safetensors"), 404)

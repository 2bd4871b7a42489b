"""Live limits against the limits in force: a real tiny-ci worker, one run.

``PATCH /api/runs/{id}/limits`` checks a body against the run's effective limits (its config
folded with the ``strategy/limits_applied`` records), ``GET /api/runs/{id}/limits`` gives
them with their history, and Compare's config diff shows the changes made during the run.
"""

from __future__ import annotations

from backend_helpers import assert_error_body, stored_records, wait_for, wait_status

from backend.limits import config_limits


def test_config_limits_are_those_of_the_runtimes_that_are_on():
    # The runtime's defaults where the config says nothing.
    assert config_limits({}) == {
        "vram_high_watermark_mb": 20000,
        "vram_low_watermark_mb": 16000,
        "prefetch_window_blocks": 2,
        "max_inflight_transfers": 2,
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


def test_limits_checked_against_those_in_force_and_listed_with_their_history(server):
    client = server.client()
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
    wait_status(client, run_id, "running")

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
    # (Before its first step the worker has no strategy yet and refuses any limits.)
    wait_for(
        lambda: any(r["kind"] == "step" for r in stored_records(client, run_id)),
        120,
        0.2,
        "a first step",
    )
    resp = client.patch(url, json={"vram_low_watermark_mb": 0.125})
    assert resp.status_code == 202, resp.text
    request_id = resp.json()["request_id"]
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
    assert client.patch(url, json={"vram_high_watermark_mb": 0.25}).status_code == 202
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
    client.post(f"/api/runs/{run_id}/cancel")
    wait_status(client, run_id, "cancelled")
    wait_status(client, other_id, {"succeeded"})

    # Compare: the config's value and, for the run that changed it, each change with its step.
    limits = client.get(url).json()
    high = limits["history"][-1] if len(limits["history"]) > 1 else None
    cmp = client.get("/api/compare", params={"ids": f"{run_id},{other_id}"}).json()
    rows = {d["path"]: d for d in cmp["config_diff"]}
    low = rows["memory.stagehand.vram_low_watermark_mb"]
    assert low["values"] == {str(run_id): 0.5, str(other_id): 0.5}
    assert low["live"] == {str(run_id): [[applied["step"], 0.125]]}
    if high is not None:  # applied before the run stopped
        assert rows["memory.stagehand.vram_high_watermark_mb"]["live"] == {
            str(run_id): [[high["step"], 0.25]]
        }
    assert "live" not in rows["max_steps"]

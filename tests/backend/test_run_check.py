"""``POST /api/runs/check`` (in-process app): every problem ``POST /api/runs`` would refuse, in one
answer, a missing folder among them even while other fields break the schema (issue 56, item
2: the folder's error came one Start after the step count's); nothing is queued."""

from __future__ import annotations

from backend_helpers import assert_error_body

MISSING = "/tmp/stagehand-check-does-not-exist"

BAD = {
    "max_steps": -3,
    "memory": {"stagehand": {"vram_high_watermark_mb": 10}},
    "data": {"path": MISSING},
}
"""The issue's form: a negative step count, a high watermark below default's low one (30 MB), a
data folder that does not exist."""


def test_every_problem_comes_back_at_once(api):
    resp = api.post("/api/runs/check", json={"preset": "default", "overrides": BAD})
    assert resp.status_code == 200
    body = resp.json()
    assert body["valid"] is False
    assert {p["field"]: p["message"] for p in body["problems"]} == {
        "overrides.memory.stagehand.vram_low_watermark_mb": (
            "vram_low_watermark_mb (30.0) must not be above vram_high_watermark_mb (10.0)"
        ),
        "overrides.max_steps": "found -3, expected greater than 0",
        "overrides.data.path": f"found '{MISSING}' (nothing), expected an existing folder",
    }
    # POST /api/runs refuses with the same three at once (the folder came at the next Start).
    err = assert_error_body(
        api.post("/api/runs", json={"preset": "default", "overrides": BAD}), 422
    )
    assert {d["field"] for d in err["details"]} == {p["field"] for p in body["problems"]}
    assert api.get("/api/runs").json()["count"] == 0


def test_a_request_post_api_runs_takes_is_valid(api, tmp_path):
    ok = {"max_steps": 3, "data": {"path": str(tmp_path)}}
    body = api.post("/api/runs/check", json={"preset": "tiny-ci", "overrides": ok}).json()
    assert body == {"valid": True, "problems": []}
    body = api.post("/api/runs/check", json={"preset": "tiny-ci"}).json()
    assert body == {"valid": True, "problems": []}


def test_a_schema_problem_in_a_folder_section_is_not_put_back(api):
    # The data section is at fault itself: its folder is not checked past its own problem.
    bad = {"data": {"path": MISSING, "limit": -1}, "max_steps": -1}
    problems = api.post("/api/runs/check", json={"preset": "tiny-ci", "overrides": bad}).json()
    fields = sorted(p["field"] for p in problems["problems"])
    assert fields == ["overrides.data.limit", "overrides.max_steps"]


def test_an_unknown_preset_is_a_404_naming_it(api):
    err = assert_error_body(api.post("/api/runs/check", json={"preset": "nope"}), 404)
    assert err["field"] == "preset"

"""The demo-asset build through the API (in-process app, the real ``workbench demo-assets``
process on a temp cache with 2 training steps per model): status and progress, a run of
``default`` refused until its assets are on disk while other presets start, a failed stage
named, the retry resuming there without rebuilding what was built, and ``default`` starting
once the files exist."""

from __future__ import annotations

import time

import pytest

TINY_BUILD = '{"vae_steps": 2, "vae_batch": 4, "base_steps": 2, "base_batch": 4, "sample_steps": 1}'


def _wait(api, states: set[str], timeout: float = 240) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = api.get("/api/assets").json()
        if body["state"] in states and not body["running"]:
            return body
        assert time.monotonic() < deadline, f"assets still {body['state']}: {body}"
        time.sleep(0.3)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STAGEHAND_WORKBENCH_DEMO_SPEC", TINY_BUILD)
    monkeypatch.setenv("STAGEHAND_WORKBENCH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_default_waits_for_its_assets_and_a_failed_stage_is_retried(api_factory, cache):
    api = api_factory(asset_cache=cache)
    body = api.get("/api/assets").json()
    assert body["state"] == "missing" and body["running"] is False and body["stages"] == []
    assert set(body["blocked_presets"]) == {"default"}
    assert "build them with the dashboard's Retry button" in body["blocked_presets"]["default"]

    r = api.post("/api/runs", json={"preset": "default"})
    assert r.status_code == 409, r.text
    err = r.json()["error"]
    assert err["code"] == "assets_not_ready" and err["field"] == "preset"
    assert err["message"].startswith(
        "this run cannot start yet: the demo assets it needs (models/flux-small-digits, "
        "data/digits-64px) are not built yet"
    )
    assert api.post("/api/runs", json={"preset": "tiny-ci"}).status_code == 201  # meanwhile
    assert api.post("/api/tunes", json={"preset": "default", "budget_mb": 60}).status_code == 409

    # A file where the demo's work folder goes: the digits build, then "demo VAE" fails.
    (cache / "build").parent.mkdir(parents=True, exist_ok=True)
    (cache / "build").write_text("in the way")
    r = api.post("/api/assets/build")
    assert r.status_code == 202 and r.json()["running"] is True
    again = api.post("/api/assets/build")
    assert again.status_code == 409 and again.json()["error"]["code"] == "conflict"
    failed = _wait(api, {"failed"})
    assert failed["failed_stage"] == "demo VAE"
    assert failed["error"].startswith("AssetError: cache folder ")
    assert "is not writable" in failed["error"]
    states = [(s["name"], s["state"]) for s in failed["stages"]]
    assert states == [
        ("digits", "done"),
        ("demo VAE", "failed"),
        ("demo base", "pending"),
        ("demo samples", "pending"),
        ("factory models", "pending"),
    ]
    digits = failed["stages"][0]
    assert digits["done"] == digits["total"] == 1797 and digits["unit"] == "images"
    assert digits["elapsed_s"] > 0
    why = api.post("/api/runs", json={"preset": "default"}).json()["error"]["message"]
    assert "the build failed at stage 'demo VAE' (AssetError: cache folder" in why
    assert "retry with the dashboard's Retry button (POST /api/assets/build)" in why
    marker = cache / "data" / "digits-64px" / ".complete"
    built_at = marker.stat().st_mtime_ns

    (cache / "build").unlink()
    assert api.post("/api/assets/build").status_code == 202
    ready = _wait(api, {"ready", "failed"})
    assert ready["state"] == "ready", ready
    assert [s["kept"] for s in ready["stages"]] == [True, False, False, False, False]
    assert marker.stat().st_mtime_ns == built_at  # the digits were not rebuilt
    assert ready["blocked_presets"] == {} and ready["estimate_s"] is None
    r = api.post("/api/runs", json={"preset": "default"})
    assert r.status_code == 201, r.text
    assert r.json()["preset"] == "default"


def test_the_server_starts_the_build_and_stops_it_on_shutdown(api_factory, cache):
    """``demo_assets`` on: the lifespan starts the build; closing the app stops it, and the
    status reads ``interrupted`` at the stage it was in (the next start resumes there)."""
    api = api_factory(asset_cache=cache, demo_assets=True)
    deadline = time.monotonic() + 60
    while True:
        body = api.get("/api/assets").json()
        if any(s["state"] == "running" for s in body["stages"]):
            break
        assert time.monotonic() < deadline, body
        time.sleep(0.05)
    assert body["state"] == "building" and body["running"] is True and body["estimate_s"] > 0
    assert body["stages"][0]["name"] == "digits" and body["stages"][0]["state"] == "running"
    assert "they are building (stage 'digits'" in body["blocked_presets"]["default"]
    api.__exit__(None, None, None)
    from workbench.worker.asset_status import current

    status = current(cache)
    assert status["state"] == "interrupted" and status["running"] is False
    assert status["failed_stage"] == "digits"

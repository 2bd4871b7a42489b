"""Real tiny-ci runs in the dashboard: Compare two presets that differ in watermarks, the Runs
table (filters, selection, notes and tags, delete), and a run that fails at run time."""

from __future__ import annotations

import copy

import pytest

from tests.frontend.conftest import Api

pytestmark = [pytest.mark.browser, pytest.mark.slow]

STEPS = 3
WATERMARKS = {"wm-wide": (4.0, 2.0), "wm-tight": (1.0, 0.5)}


@pytest.fixture(scope="module")
def compared_runs(backend_server):
    """Two finished tiny-ci runs from presets that differ only in the weight watermarks."""
    api = Api(backend_server)
    base = api.call("GET", "/api/presets/tiny-ci")["config"]
    ids = {}
    for name, (high, low) in WATERMARKS.items():
        config = copy.deepcopy(base)
        config["name"] = name
        config["max_steps"] = STEPS
        config["memory"]["stagehand"]["vram_high_watermark_mb"] = high
        config["memory"]["stagehand"]["vram_low_watermark_mb"] = low
        api.call("POST", "/api/presets", {"name": name, "config": config})
        ids[name] = api.call("POST", "/api/runs", {"preset": name, "name": f"run-{name}"})["id"]
    for run_id in ids.values():
        api.wait_run(run_id, {"succeeded", "failed", "crashed", "killed"}, timeout=240)
    return ids


def test_compare_overlays_and_config_diff(backend_server, compared_runs, page, shoot):
    api = Api(backend_server)
    for run_id in compared_runs.values():
        assert api.call("GET", f"/api/runs/{run_id}")["status"] == "succeeded"
    a, b = compared_runs["wm-wide"], compared_runs["wm-tight"]

    # Select both on the Runs page and open Compare from there.
    page.goto(backend_server + "/#/runs")
    page.wait_for_selector(f"tr[data-run-id='{a}']")
    assert page.is_disabled("#compare-selected")
    page.check(f"tr[data-run-id='{a}'] input.select-run")
    page.check(f"tr[data-run-id='{b}'] input.select-run")
    page.click("#compare-selected")
    page.wait_for_url(f"**/#/compare?ids={a},{b}")
    page.wait_for_selector("#config-diff tr[data-path]")

    # The config diff holds only differing fields, watermarks among them, with both values.
    rows = page.eval_on_selector_all(
        "#config-diff tr[data-path]",
        "rows => rows.map(r => [r.dataset.path, ...Array.from(r.cells).slice(1).map(c => c.innerText)])",
    )
    paths = {r[0]: r[1:] for r in rows}
    assert paths["memory.stagehand.vram_high_watermark_mb"] == ["4", "1"]
    assert paths["memory.stagehand.vram_low_watermark_mb"] == ["2", "0.5"]
    assert "learning_rate" not in paths and "max_steps" not in paths

    # Overlays: one trace per run on each chart, loss values equal to the runs' records.
    for chart in ("cmp-vram", "cmp-step", "cmp-loss", "cmp-spill"):
        assert page.evaluate(f"document.getElementById('{chart}').data.length") == 2
    for i, run_id in enumerate((a, b)):
        xs = page.evaluate(f"Array.from(document.getElementById('cmp-loss').data[{i}].x)")
        ys = page.evaluate(f"Array.from(document.getElementById('cmp-loss').data[{i}].y)")
        steps = api.call("GET", f"/api/runs/{run_id}/telemetry?source=trainer&kind=step")["data"]
        assert xs == list(range(1, STEPS + 1))
        assert ys == pytest.approx([r["loss"] for r in steps])
    # The tighter weight watermarks evict sooner: its peak VRAM line lies below the wider one's.
    peaks = page.evaluate("document.getElementById('cmp-vram').data.map(t => Math.max(...t.y))")
    assert peaks[0] > peaks[1] > 0
    spill = page.evaluate("document.getElementById('cmp-spill').data.map(t => t.x.length)")
    assert spill == [STEPS, STEPS]
    summary = page.eval_on_selector_all(
        "#compare-summary tbody tr", "rows => rows.map(r => r.dataset.runId)"
    )
    assert summary == [str(a), str(b)]
    shoot(backend_server + f"/#/compare?ids={a},{b}", "compare", ready="#config-diff tr[data-path]")


def test_runs_table_filters_notes_tags_delete(backend_server, compared_runs, page, shoot):
    api = Api(backend_server)
    a, b = compared_runs["wm-wide"], compared_runs["wm-tight"]
    page.goto(backend_server + "/#/runs")
    row = page.wait_for_selector(f"tr[data-run-id='{a}']")
    assert row.query_selector(".badge").get_attribute("data-status") == "succeeded"
    assert row.query_selector("td:nth-child(7)").inner_text() == f"{STEPS}/{STEPS}"

    # Notes and tags are saved through PATCH and shown in the row.
    row.query_selector("button:has-text('Notes')").click()
    page.fill(f"tr[data-editor-for='{a}'] .notes-input", "wide watermarks")
    page.fill(f"tr[data-editor-for='{a}'] .tags-input", "sweep, wide")
    page.click(f"tr[data-editor-for='{a}'] .save-notes")
    page.wait_for_selector(f"tr[data-run-id='{a}'] .tag:has-text('wide')")
    assert api.call("GET", f"/api/runs/{a}")["tags"] == ["sweep", "wide"]

    # Filters: a search over names and tags, a preset.
    page.fill("#filter-tag", "wide")
    page.wait_for_function(
        f"document.querySelectorAll('#runs-body tr[data-run-id]').length === 1"
        f" && !!document.querySelector(\"tr[data-run-id='{a}']\")"
    )
    page.fill("#filter-tag", "")
    page.select_option("#filter-preset", "wm-tight")
    page.wait_for_function(
        "Array.from(document.querySelectorAll('#runs-body tr[data-run-id]'))"
        f".map(r => r.dataset.runId).join() === '{b}'"
    )
    page.select_option("#filter-preset", "")
    page.wait_for_selector(f"tr[data-run-id='{a}']")
    shoot(backend_server + "/#/runs", "runs", ready="#runs-body tr")

    # No Delete while a run is queued or running; once it ended, Delete (after the confirm
    # dialog) removes the row without a reload.
    extra = api.call(
        "POST",
        "/api/runs",
        {"preset": "tiny-ci", "name": "to-delete", "overrides": {"max_steps": 100000}},
    )
    api.wait_run(extra["id"], {"running"}, timeout=240)
    page.wait_for_selector(f"tr[data-run-id='{extra['id']}'] .badge[data-status='running']")
    assert page.query_selector(f"tr[data-run-id='{extra['id']}'] button.danger") is None
    api.call("POST", f"/api/runs/{extra['id']}/cancel")
    page.wait_for_selector(f"tr[data-run-id='{extra['id']}'] button.danger", timeout=60_000)
    page.once("dialog", lambda dialog: dialog.accept())
    page.click(f"tr[data-run-id='{extra['id']}'] button.danger")
    page.wait_for_selector(f"tr[data-run-id='{extra['id']}']", state="detached")
    runs = api.call("GET", "/api/runs")["data"]
    assert extra["id"] not in [r["id"] for r in runs]


def test_failed_run_shows_its_error_and_traceback(backend_server, page, shoot, tmp_path):
    api = Api(backend_server)
    empty = tmp_path / "no-images"
    empty.mkdir()
    # Passes validation (the folder exists) and fails in the worker (nothing to train on).
    run = api.call(
        "POST",
        "/api/runs",
        {
            "preset": "tiny-ci",
            "name": "bad-data",
            "overrides": {"data": {"factory": None, "path": str(empty)}},
        },
    )
    done = api.wait_run(run["id"], {"succeeded", "failed", "crashed", "cancelled"}, timeout=240)
    assert done["status"] == "failed", done
    page.goto(backend_server + f"/#/runs/{run['id']}")
    page.wait_for_selector("#run-error:not([hidden])")
    assert page.get_attribute(".run-header .badge", "data-status") == "failed"
    message = page.inner_text("#run-error .error-message")
    assert message == done["error"]["message"]
    assert str(empty) in message or "image" in message.lower()
    if done["error"].get("traceback"):
        assert "Traceback" in page.inner_text("#run-error pre.traceback")
    shoot(backend_server + f"/#/runs/{run['id']}", "run-failed", ready="#run-error:not([hidden])")

"""Tunes on a server whose worker is the synthetic one (its peak follows the high
watermark and its step time the blocks it loads, so trials differ): trials are ordinary runs of
one group with figures measured from their telemetry, the Pareto front marks exactly the
non-dominated trials, the chosen trial saves as a preset, the group cancels as one, bad input is
one 422 naming the field; the tune page, the run page's plan-vs-measured card of a trial (the
calibration it left) and the New run page's calibrated plan in the browser."""

from __future__ import annotations

import copy
import re
import uuid

import httpx
import pytest

from tests.frontend.conftest import Api, picture

# block_mb/base_mb/ms_per_load: the synthetic run's MB and ms (see its docstring); device_name:
# its run_started record's, so that the server calibrates plans on rtx4090 by its trials.
SYNTH = "step_s=0.01 block_mb=0.2 base_mb=0.4 ms_per_load=5 device_name=NVIDIA_GeForce_RTX_4090"
BUDGET = 3.0


def _preset(api: Api, description: str) -> str:
    name = f"tune-{uuid.uuid4().hex[:6]}"
    config = copy.deepcopy(api.call("GET", "/api/presets/tiny-ci")["config"])
    config.update(name=name, description=description)
    api.call("POST", "/api/presets", {"name": name, "config": config})
    return name


def _wait(api: Api, path: str, done, timeout: float = 120):
    import time

    deadline = time.monotonic() + timeout
    while not done(out := api.call("GET", path)):
        assert time.monotonic() < deadline, f"{path}: not done after {timeout} s: {out}"
        time.sleep(0.2)
    return out


@pytest.fixture(scope="module")
def tune(synthetic_server):
    """A finished tune within 3 MB on rtx4090: the preset's own limits, one candidate, the
    preset's own again; one step after the trace step each."""
    api = Api(synthetic_server)
    preset = _preset(api, SYNTH)
    body = {"preset": preset, "budget_mb": BUDGET, "device": "rtx4090", "trial_steps": 1}
    made = api.call("POST", "/api/tunes", {**body, "max_trials": 3})
    return _wait(api, f"/api/tunes/{made['id']}", lambda t: t["active"] == 0)


def test_trials_are_runs_of_one_group_with_measured_figures_and_pareto(synthetic_server, tune):
    api = Api(synthetic_server)
    ids = [t["run_id"] for t in tune["trials"]]
    assert [t["label"] for t in tune["trials"]] == ["preset", "t1", "preset-last"]
    runs = api.call("GET", f"/api/runs?group={tune['id']}")["data"]
    assert sorted(r["id"] for r in runs) == sorted(ids)
    assert {r["group_id"] for r in runs} == {tune["id"]}
    points = []
    for t in tune["trials"]:
        run = api.call("GET", f"/api/runs/{t['run_id']}")
        assert run["status"] == "succeeded" and run["config"]["max_steps"] == 2
        assert run["name"] == f"tune{tune['id']}-{t['label']}"
        sh = run["config"]["memory"]["stagehand"]
        assert sh["vram_high_watermark_mb"] == t["limits"]["high_mb"]
        recs = api.call("GET", f"/api/runs/{run['id']}/telemetry?limit=10000")["data"]
        steps = [r for r in recs if r["source"] == "trainer" and r["kind"] == "step"]
        past_trace = [r["step_time_ms"] for r in steps if r["step"] > 1]
        assert t["measured"]["step_ms"] == pytest.approx(sum(past_trace) / len(past_trace))
        assert t["measured"]["peak_mb"] == run["summary"]["peak_vram_mb"]
        points.append((t["measured"]["step_ms"], t["measured"]["peak_mb"]))
    assert len({p[1] for p in points}) > 1  # the trials really differ
    for t, p in zip(tune["trials"], points, strict=True):
        dominated = any(q[0] <= p[0] and q[1] <= p[1] and q != p for q in points)
        assert t["pareto"] is (not dominated)
    fits = [t for t in tune["trials"] if t["measured"]["peak_mb"] <= BUDGET]
    assert tune["best_run_id"] == min(fits, key=lambda t: t["measured"]["step_ms"])["run_id"]


def test_cancel_cancels_every_queued_and_running_trial(synthetic_server):
    api = Api(synthetic_server)
    preset = _preset(api, "step_s=1")
    body = {"preset": preset, "budget_mb": BUDGET, "device": "rtx4090", "max_trials": 3}
    ids = [t["run_id"] for t in api.call("POST", "/api/tunes", body)["trials"]]
    tune_id = api.call("GET", f"/api/runs/{ids[0]}")["group_id"]
    _wait(api, f"/api/runs/{ids[0]}", lambda r: r["status"] == "running", 60)
    out = api.call("POST", f"/api/tunes/{tune_id}/cancel")
    assert [t["status"] for t in out["trials"]][1:] == ["cancelled", "cancelled"]  # were queued
    _wait(api, f"/api/tunes/{tune_id}", lambda t: t["active"] == 0, 30)
    assert {api.call("GET", f"/api/runs/{i}")["status"] for i in ids} == {"cancelled"}


def test_bad_input_is_a_422_naming_the_field(synthetic_server):
    cases = [
        # The minimum as planned (1.54 MB) times the VRAM ratio of the trials' calibration.
        (
            {"budget_mb": 1},
            "budget_mb",
            "below the smallest feasible plan of this preset on rtx4090",
        ),
        ({"budget_mb": 0}, "budget_mb", "greater than 0"),
        ({"device": "gtx480"}, "device", "unknown profile"),
        ({"trial_steps": 0}, "trial_steps", "greater than or equal to 1"),
        ({"preset": "nope"}, "preset", "no preset named"),
    ]
    before = Api(synthetic_server).call("GET", "/api/runs")["count"]
    for change, field, text in cases:
        body = {"preset": "tiny-ci", "budget_mb": BUDGET, "device": "rtx4090", **change}
        res = httpx.post(synthetic_server + "/api/tunes", json=body, timeout=60)
        assert res.status_code == (404 if field == "preset" else 422), res.text
        error = res.json()["error"]
        assert error["field"] == field and text in error["message"], error
    assert Api(synthetic_server).call("GET", "/api/runs")["count"] == before


@pytest.mark.browser
def test_tune_page_run_overlay_and_calibrated_plan(synthetic_server, tune, page, shoot):
    api = Api(synthetic_server)
    page.goto(f"{synthetic_server}/#/tunes/{tune['id']}")
    page.wait_for_selector("#tune-table tbody tr")
    marks = page.eval_on_selector_all(
        "#tune-table tbody tr", "rows => rows.map(r => [Number(r.dataset.runId), r.dataset.pareto])"
    )
    assert marks == [[t["run_id"], str(t["pareto"]).lower()] for t in tune["trials"]]
    page.wait_for_selector("#tune-chart .main-svg")
    names = page.evaluate("document.getElementById('tune-chart').data.map(t => t.name)")
    assert names[:3] == ["predicted", "measured", "Pareto front (measured)"]
    front = page.evaluate("document.getElementById('tune-chart').data[2].x.length")
    assert front == sum(t["pareto"] for t in tune["trials"])
    best = tune["best_run_id"]
    assert f"run #{best}" in page.inner_text("#tune-best")
    # Candidates, not distinct predictions, are counted; MB under 10 to the hundredth.
    header = page.inner_text("#tune-header")
    assert (
        f"{tune['searched']} candidates simulated, {tune['feasible']} predicted to fit " in header
    )
    assert f"({tune['distinct']} distinct predictions)" in header
    assert tune["feasible"] > tune["distinct"] and f"within {BUDGET:.2f} MB" in header
    assert f"smallest feasible peak is {tune['min_peak_mb']:.2f} MB" in header
    shoot(f"{synthetic_server}/#/tunes/{tune['id']}", "tune-result", ready="#tune-chart .main-svg")

    row = f"#tune-table tr[data-run-id='{best}']"
    page.fill(f"{row} input.preset-name", f"tuned-{tune['id']}")
    page.click(f"{row} button.save-preset")
    page.wait_for_selector(f"{row} a.saved")
    saved = api.call("GET", f"/api/presets/tuned-{tune['id']}")["config"]
    trial = next(t for t in tune["trials"] if t["run_id"] == best)
    assert saved["max_steps"] == 8  # the preset's own, not the trial's
    assert saved["memory"]["stagehand"]["vram_high_watermark_mb"] == trial["limits"]["high_mb"]

    # The trial's run page: its plan next to what it measured (the calibration it left).
    found = _wait_calibration(synthetic_server, best)
    page.goto(f"{synthetic_server}/#/runs/{best}")
    page.wait_for_selector("#run-calibration #calibration-chart .main-svg")
    ratio = page.inner_text("#calibration-table tr[data-figure='peak_vram_mb'] td:last-child")
    assert ratio == f"×{found['ratios']['peak_vram_mb']:.3f}"
    traces = page.evaluate("document.getElementById('calibration-chart').data.length")
    assert traces == 4  # predicted and measured curves, their peaks
    # What a steady step moves, planned beside the run's last step: shown, not a ratio.
    for figure in ("block_loads_per_step", "misses_per_step"):
        cells = page.eval_on_selector_all(
            f"#calibration-table tr[data-figure='{figure}'] td", "tds => tds.map(t => t.innerText)"
        )
        p, m = found["predicted"][figure], found["measured"][figure]
        assert cells[1:3] == [f"{p:g}", f"{m:g}"], (figure, cells)
        if p == m:
            assert cells[3] == "equal"
        elif p > 0 and m > 0:
            assert cells[3] == f"×{m / p:.3f}"
        else:
            assert cells[3] == f"{'+' if m > p else ''}{m - p:g}"
        assert figure not in found["ratios"]
    picture(page, "tune-trial-run-desktop", full_page=True)

    # New run: the plan of that preset on rtx4090 is calibrated by the newest trial's ratios.
    page.goto(f"{synthetic_server}/#/new?preset={tune['preset']}")
    page.wait_for_selector(f"#preset-select option[value='{tune['preset']}']", state="attached")
    page.select_option("#plan-device", "rtx4090")
    page.click("#plan-run")
    page.wait_for_selector("#plan-calibration")
    # By the trials' median; a step ratio no model error explains (the synthetic worker's
    # sleeps against a GPU's predicted fractions of a ms) is refused, and said so.
    text = page.inner_text("#plan-calibration")
    assert re.search(r"^calibrated by runs? #\d+(, #\d+)* on rtx4090/", text), text
    page.fill("#tune-budget", "1")
    page.click("#tune-run")
    page.wait_for_selector("#plan-errors :text('budget_mb')")
    assert re.search(
        r"smallest feasible plan .*: \d+\.\d\d MB peak", page.inner_text("#plan-errors")
    )
    picture(page, "new-run-calibrated-plan", full_page=True)


def _wait_calibration(base: str, run_id: int, timeout: float = 60) -> dict:
    import time

    deadline = time.monotonic() + timeout
    while (res := httpx.get(f"{base}/api/runs/{run_id}/calibration")).status_code == 404:
        assert time.monotonic() < deadline, f"no calibration of run {run_id}"
        time.sleep(0.2)
    return res.json()

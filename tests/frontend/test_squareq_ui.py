"""The New run page's SquareQ switch: it writes ``memory.stagehand.squareq.format`` into the
config (off removes the section), and the Plan panel then shows what 8 bits save: the host
cache the plan counts falls to the images' bytes."""

from __future__ import annotations

import json
import re

import pytest

from tests.frontend.conftest import PHONE, SHOTS, TAKE_SHOTS, picture

pytestmark = [pytest.mark.browser]


def host_cache_mb(page, before: str = "") -> float:
    """Plan the config and read the host cache figure (once the panel shows a new plan)."""
    page.click("#plan-run")
    page.wait_for_function(
        "(b) => { const el = document.querySelector('#plan-host'); return el && el.innerText !== b; }",
        arg=before,
    )
    text = page.inner_text("#plan-host")
    return float(re.search(r"of it host cache ([\d.]+) MiB", text).group(1))


def test_squareq_switch_and_what_it_saves(backend_server, page):
    page.goto(backend_server + "/#/new")
    page.wait_for_selector("#preset-select option[value='tiny-ci']", state="attached")
    page.select_option("#preset-select", "tiny-ci")
    page.select_option("#plan-device", "rtx4090")
    assert page.input_value("#field-squareq_format") == ""  # off in the preset
    full = host_cache_mb(page)
    page.select_option("#field-squareq_format", "int8")
    config = json.loads(page.input_value("#config-json"))
    assert config["memory"]["stagehand"]["squareq"] == {"format": "int8"}
    eight = host_cache_mb(page, before=page.inner_text("#plan-host"))
    assert 0 < eight <= 0.56 * full  # tiny-ci is fp32: 8 bits are about a quarter
    picture(page, "new-run-squareq", full_page=True)
    page.set_viewport_size({"width": 390, "height": 844})
    picture(page, "new-run-squareq-phone", full_page=True)
    page.select_option("#field-squareq_format", "")
    config = json.loads(page.input_value("#config-json"))
    assert "squareq" not in config["memory"]["stagehand"]  # off: the section is gone


def test_run_page_weights_fact_says_squareq(backend_server, page, tmp_path):
    """A tiny-ci run in int8: the weights fact carries the last ``squareq/step`` note (format,
    the images' share, the bytes dequantized, the worst layer's error)."""
    from tests.frontend.conftest import Api

    api = Api(backend_server)
    squareq = {"format": "int8", "cache_dir": str(tmp_path / "sq")}
    body = {
        "preset": "tiny-ci",
        "name": "squareq",
        # Two steps: the note is the last record's, the error table the first's.
        "overrides": {"max_steps": 2, "memory": {"stagehand": {"squareq": squareq}}},
    }
    run_id = api.call("POST", "/api/runs", body)["id"]
    api.wait_run(run_id, {"succeeded"})
    note = api.call("GET", f"/api/runs/{run_id}")["summary"]["weights_squareq"]
    assert note.startswith("SquareQ int8: blocks held and copied in 8 bits (0.27x")
    # The plan of the same config reads the error table the run's first record carries from
    # the SquareQ cache the run built (same key: nothing quantized in the request).
    from workbench.worker.preset import load_preset

    first = api.call("GET", f"/api/runs/{run_id}/telemetry?source=squareq&kind=step")["data"][0]
    _, preset = load_preset("tiny-ci")
    preset["memory"]["stagehand"]["squareq"] = squareq
    q = api.call("POST", "/api/plan", {"preset": preset, "device": "rtx4090"})["quant_error"]
    assert q["measured"] and q["cached"] is True and first["quantized_layers"] > 0
    table = ("quantized_layers", "rel_rms_mean", "rel_rms_max", "worst_layer", "worst_layers")
    assert {k: q[k] for k in table} == {k: first[k] for k in table}
    page.goto(f"{backend_server}/#/runs/{run_id}")
    page.wait_for_selector("#fact-weights .fact-squareq")
    assert page.inner_text("#fact-weights .fact-squareq") == note
    picture(page, "run-squareq", full_page=False)


def test_plan_panel_shows_the_quantization_error(backend_server, page, tmp_path):
    """With SquareQ on, the Plan panel shows the quantization error of the model's weights
    once SquareQ's cache holds them (a request never quantizes: before, "not measured"), with
    the figures ``workbench plan`` computed into that cache."""
    from workbench.plan import plan_preset, profile
    from workbench.worker.assets import build_model

    build_model("flux", "tiny")  # the folder a tiny-ci run streams (built once in the cache)
    page.goto(backend_server + "/#/new")
    page.wait_for_selector("#preset-select option[value='tiny-ci']", state="attached")
    page.select_option("#preset-select", "tiny-ci")
    page.select_option("#plan-device", "rtx4090")
    page.select_option("#field-squareq_format", "int8")
    config = json.loads(page.input_value("#config-json"))
    config["memory"]["stagehand"]["squareq"]["cache_dir"] = str(tmp_path / "sq")
    page.fill("#config-json", json.dumps(config))
    page.click("#plan-run")
    page.wait_for_selector("#plan-quant-error", timeout=120_000)
    before = page.inner_text("#plan-quant-error")
    assert before.startswith("SquareQ int8: not measured: not in the SquareQ cache yet")
    q = plan_preset(config, profile("rtx4090"), quant_error="compute").quant_error
    assert q["measured"] and q["cached"] is False
    page.click("#plan-run")
    page.wait_for_function(
        "(b) => { const el = document.querySelector('#plan-quant-error'); "
        "return el && el.innerText !== b; }",
        arg=before,
    )
    assert page.inner_text("#plan-quant-error") == (
        f"SquareQ int8: {q['quantized_layers']} layers, relative RMS error mean "
        f"{100 * q['rel_rms_mean']:.3f}%, worst {100 * q['rel_rms_max']:.3f}% ({q['worst_layer']})"
    )
    assert page.get_attribute("#plan-quant-error", "title").startswith(
        f"five worst: {q['worst_layer']} "
    )
    if TAKE_SHOTS:
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / "new-run-plan-squareq.png"), full_page=True)
        page.set_viewport_size(PHONE)
        page.wait_for_timeout(300)
        page.screenshot(path=str(SHOTS / "new-run-plan-squareq-phone.png"), full_page=True)

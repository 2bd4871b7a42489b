"""The run page's Outputs card and worker log, on one run stopped before its end: its output
is readable on the page while it runs; once stopped, its LoRA downloads through the link and
loads, its checkpoints are listed, and it resumes from the last one with a click."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from tests.frontend.conftest import Api

pytestmark = [pytest.mark.browser, pytest.mark.slow]

TERMINAL = {"succeeded", "failed", "cancelled", "killed", "crashed"}
LOG = "document.getElementById('worker-log-text').textContent"


def test_worker_log_lora_download_and_resume_from_the_run_page(
    backend_server, page, shoot, tmp_path
):
    api = Api(backend_server)
    # No checkpoint_every: the stop itself leaves the checkpoint that Continue starts from.
    overrides = {"max_steps": 100000, "checkpoint_every": None}
    run_id = api.call("POST", "/api/runs", {"preset": "tiny-ci", "overrides": overrides})["id"]

    # While it runs, the worker's own output is on its page (refreshed every 3 s).
    page.goto(f"{backend_server}/#/runs/{run_id}")
    page.wait_for_selector(".run-header .badge[data-status='running']", timeout=120_000)
    page.click("#worker-log summary")
    page.wait_for_function(f"/step \\d+\\/100000 loss/.test({LOG})", timeout=60_000)
    first = page.text_content("#worker-log-text")
    page.wait_for_function(f"{LOG} !== {first!r}", timeout=30_000)

    # A second run waits for the worker slot: its page says behind which run.
    queued = api.call("POST", "/api/runs", {"preset": "tiny-ci"})["id"]
    page.goto(f"{backend_server}/#/runs/{queued}")
    page.wait_for_function(
        "document.querySelector('#fact-stage .fact-value')?.textContent"
        f" === 'queued behind #{run_id}'"
    )
    api.call("POST", f"/api/runs/{queued}/cancel")
    assert api.wait_run(queued, TERMINAL)["status"] == "cancelled"
    page.goto(f"{backend_server}/#/runs/{run_id}")
    api.call("POST", f"/api/runs/{run_id}/cancel")
    assert api.wait_run(run_id, TERMINAL)["status"] == "cancelled"

    # Stopped: the LoRA it saved downloads and loads; its checkpoints offer a resume.
    page.goto(f"{backend_server}/#/runs/{run_id}")
    # A locator, not a handle: the card may draw its links again as the run's records arrive.
    link = page.locator("#lora-files a.lora-link")
    assert link.inner_text() == "pytorch_lora_weights.safetensors"
    with page.expect_download() as info:
        link.click()
    path = tmp_path / info.value.suggested_filename
    info.value.save_as(path)
    assert path.name == f"run-{run_id}-pytorch_lora_weights.safetensors"
    weights = load_file(path)
    assert weights and all("lora_A" in k or "lora_B" in k for k in weights)
    saved = api.call("GET", f"/api/runs/{run_id}/outputs")["checkpoints"]
    steps_done = api.call("GET", f"/api/runs/{run_id}")["summary"]["steps_done"]
    assert [c["step"] for c in saved] == [steps_done]  # the stop's own checkpoint
    assert page.inner_text("#checkpoint-list").count("step-") == 1
    button = page.wait_for_selector("#resume-run")
    assert button.inner_text() == f"Continue from step {steps_done}"
    shoot(f"{backend_server}/#/runs/{run_id}", "run-outputs", ready="#resume-run")
    button.click()
    page.wait_for_selector(".run-header .badge[data-status='running']", timeout=120_000)
    api.call("POST", f"/api/runs/{run_id}/cancel")
    assert api.wait_run(run_id, TERMINAL)["status"] == "cancelled"


def test_samples_grid_with_a_step_slider_and_side_by_side_in_compare(backend_server, page, shoot):
    """Samples drawn before the first step (0), every 3 steps (3, 6) and at the end: one slider
    position per step, the newest shown first beside step 0's, and moving the slider shows that
    step's images; Compare shows two runs' samples side by side at the step its slider picks."""
    api = Api(backend_server)
    prompts = ["a handwritten digit three", "a handwritten digit seven"]
    overrides = {"max_steps": 8, "samples": {"every": 3, "prompts": prompts}}
    run_id = api.call("POST", "/api/runs", {"preset": "tiny-ci", "overrides": overrides})["id"]
    other = {**overrides, "learning_rate": 0.01, "samples": {"every": 6, "prompts": prompts}}
    other_id = api.call("POST", "/api/runs", {"preset": "tiny-ci", "overrides": other})["id"]
    assert api.wait_run(run_id, TERMINAL)["status"] == "succeeded"
    assert api.wait_run(other_id, TERMINAL)["status"] == "succeeded"
    page.goto(f"{backend_server}/#/runs/{run_id}")
    page.wait_for_selector("#samples figure img")
    page.wait_for_function("document.getElementById('sample-step').max === '3'")
    assert page.input_value("#sample-step") == "3"
    assert page.text_content("#sample-step-label") == "final (step 8) · 4 of 4"
    captions = page.eval_on_selector_all(
        "#samples figcaption", "els => els.map(e => e.textContent)"
    )
    assert captions == prompts

    def shown(selector: str) -> list[str]:
        srcs = page.eval_on_selector_all(selector, "els => els.map(e => e.getAttribute('src'))")
        return [s.rsplit("/", 1)[1] for s in srcs]

    # Each prompt's final image beside its step-0 image (the model before training).
    assert shown("#samples .sample-now img") == ["sample-00.png", "sample-01.png"]
    assert shown("#samples .sample-before img") == ["step-000000-00.png", "step-000000-01.png"]
    labels = page.eval_on_selector_all(
        "#samples figure:first-child .sample-at", "els => els.map(e => e.textContent)"
    )
    assert labels == ["step 0", "final (step 8)"]
    page.fill("#sample-step", "1")  # a range input takes fill: the value, then an input event
    page.wait_for_function("document.querySelector('#samples figure').dataset.step === '3'")
    assert shown("#samples .sample-now img") == ["step-000003-00.png", "step-000003-01.png"]
    assert shown("#samples .sample-before img") == ["step-000000-00.png", "step-000000-01.png"]
    assert page.text_content("#sample-step-label") == "step 3 · 2 of 4"
    page.fill("#sample-step", "0")  # step 0 itself: nothing beside it
    page.wait_for_function("document.querySelector('#samples figure').dataset.step === '0'")
    assert shown("#samples img") == ["step-000000-00.png", "step-000000-01.png"]
    shoot(f"{backend_server}/#/runs/{run_id}", "run-samples", ready="#samples figure img")

    page.goto(f"{backend_server}/#/compare?ids={run_id},{other_id}")
    page.wait_for_selector("#compare-sample-rows .compare-sample-row img")
    rows = "#compare-sample-rows .compare-sample-row"
    assert page.text_content("#compare-sample-label") == "final · 4 of 4"
    assert page.eval_on_selector_all(
        rows, "rs => rs.map(r => r.querySelectorAll('img').length)"
    ) == [2, 2]
    page.fill("#compare-sample-step", "1")  # step 3: only the first run sampled there
    page.wait_for_function(
        "document.getElementById('compare-sample-label').textContent.startsWith('step 3')"
    )
    texts = page.eval_on_selector_all(rows, "rs => rs.map(r => r.querySelectorAll('img').length)")
    assert texts == [2, 0]
    assert "no samples at step 3" in page.inner_text(f"{rows}[data-run-id='{other_id}']")
    shoot(
        f"{backend_server}/#/compare?ids={run_id},{other_id}",
        "compare-samples",
        ready="#compare-sample-rows img",
    )

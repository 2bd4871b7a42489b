"""The run page's Outputs card: the LoRA downloads through its link and loads; a run stopped
before its end lists its checkpoints and resumes from the last one with a click."""

from __future__ import annotations

import time

import pytest
from safetensors.torch import load_file

from tests.frontend.conftest import Api

pytestmark = [pytest.mark.browser, pytest.mark.slow]

TERMINAL = {"succeeded", "failed", "cancelled", "killed", "crashed"}


def test_lora_download_and_resume_from_the_run_page(backend_server, page, shoot, tmp_path):
    api = Api(backend_server)
    done = api.call(
        "POST",
        "/api/runs",
        {"preset": "tiny-ci", "overrides": {"max_steps": 8, "checkpoint_every": 4}},
    )["id"]
    assert api.wait_run(done, TERMINAL)["status"] == "succeeded"
    page.goto(f"{backend_server}/#/runs/{done}")
    link = page.wait_for_selector("#lora-files a.lora-link")
    assert link.inner_text() == "pytorch_lora_weights.safetensors"
    assert page.inner_text("#checkpoint-list").count("step-") == 2
    assert page.query_selector("#resume-run") is None  # it ended at its last step
    with page.expect_download() as info:
        link.click()
    path = tmp_path / info.value.suggested_filename
    info.value.save_as(path)
    assert path.name == f"run-{done}-pytorch_lora_weights.safetensors"
    weights = load_file(path)
    assert weights and all("lora_A" in k or "lora_B" in k for k in weights)

    stopped = api.call(
        "POST",
        "/api/runs",
        {"preset": "tiny-ci", "overrides": {"max_steps": 100000, "checkpoint_every": 4}},
    )["id"]
    deadline = time.monotonic() + 180
    while not api.call("GET", f"/api/runs/{stopped}/outputs")["checkpoints"]:
        assert time.monotonic() < deadline, "no checkpoint written"
        time.sleep(0.3)
    api.call("POST", f"/api/runs/{stopped}/cancel")
    assert api.wait_run(stopped, TERMINAL)["status"] == "cancelled"
    page.goto(f"{backend_server}/#/runs/{stopped}")
    button = page.wait_for_selector("#resume-run")
    last = api.call("GET", f"/api/runs/{stopped}/outputs")["checkpoints"][-1]["name"]
    assert button.inner_text() == f"Resume from {last}"
    shoot(f"{backend_server}/#/runs/{stopped}", "run-outputs", ready="#resume-run")
    button.click()
    page.wait_for_selector(".run-header .badge[data-status='running']", timeout=120_000)
    api.call("POST", f"/api/runs/{stopped}/cancel")
    assert api.wait_run(stopped, TERMINAL)["status"] == "cancelled"

"""A run started from a pipeline folder on the New run page: the folder is inspected (family,
components, streamed blocks) through ``POST /api/pipelines/inspect``, used as ``model.path``, and
the real ``workbench train`` worker trains the tiny FluxPipeline to the end; from the empty page
with the form alone, on a folder of captioned images with the user's sample prompts."""

from __future__ import annotations

import json
import re

import pytest

from tests.fixtures.images import captioned_images
from tests.frontend.conftest import Api, picture

pytestmark = [pytest.mark.browser]


@pytest.fixture(scope="module")
def flux_folder(asset_cache):
    """The tiny FluxPipeline folder, built once a session (the plan tests read the same)."""
    from tests.fixtures.pipelines import build_pipeline

    return build_pipeline("flux", asset_cache)


def test_inspect_endpoint_numbers_and_error_shape(backend_server, flux_folder):
    import urllib.error
    import urllib.request

    api = Api(backend_server)
    info = api.call("POST", "/api/pipelines/inspect", {"path": str(flux_folder)})
    assert info["family"] == "flux" and info["trainable"] is True
    assert [b["name"] for b in info["blocks"]][:1] == ["transformer_blocks.0"]
    assert len(info["blocks"]) == 8 and info["largest_block_bytes"] > 0
    classes = {c["name"]: c["class_name"] for c in info["components"]}
    assert classes["text_encoder_2"] == "T5EncoderModel"
    req = urllib.request.Request(
        backend_server + "/api/pipelines/inspect",
        data=json.dumps({"path": str(flux_folder / "vae")}).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as exc:
        urllib.request.urlopen(req, timeout=30)
    body = json.loads(exc.value.read())
    assert exc.value.code == 422 and body["error"]["field"] == "path"
    assert "model_index.json: not found" in body["error"]["message"]


def test_start_a_run_from_a_pipeline_folder(backend_server, flux_folder, page):
    api = Api(backend_server)
    page.goto(backend_server + "/#/new")
    page.wait_for_selector("#preset-select option[value='tiny-ci']", state="attached")
    page.select_option("#preset-select", "tiny-ci")
    page.fill("#pipeline-path", str(flux_folder))
    page.click("#inspect-pipeline")
    page.wait_for_selector("#pipeline-found")
    assert page.inner_text("#pipeline-family") == "flux"
    assert page.inner_text("#pipeline-blocks").startswith("8 blocks streamed")
    row = page.inner_text("#pipeline-components tr[data-component='transformer']")
    assert "FluxTransformer2DModel" in row and "float32" in row
    picture(page, "new-run-pipeline", full_page=True)
    page.click("#use-pipeline")
    config = json.loads(page.input_value("#config-json"))
    assert config["model"]["path"] == str(flux_folder) and "factory" not in config["model"]
    assert "expert" not in config["model"] and page.is_hidden("#pipeline-expert")
    assert page.input_value("#field-model") == str(flux_folder)
    picture(page, "new-run-pipeline-used", full_page=True)
    page.fill("#field-max_steps", "3")
    page.fill("#run-name", "ui-pipeline")
    page.click("#start-run")
    page.wait_for_url(re.compile(r"#/runs/\d+$"))
    run_id = int(page.url.rsplit("/", 1)[1])
    run = api.wait_run(run_id, {"succeeded", "failed", "crashed"}, timeout=240)
    assert run["status"] == "succeeded", run.get("error")
    assert run["config"]["model"]["path"] == str(flux_folder)
    assert run["summary"]["steps_done"] == 3


def test_my_pipeline_my_images_my_prompts_from_the_empty_page_without_json(
    backend_server, flux_folder, page, tmp_path
):
    """The whole way a user trains on their own data, by the form alone: before, the data folder
    and the prompts were JSON edits refused three times, and the digit prompts captioned the
    samples."""
    api = Api(backend_server)
    images = captioned_images(tmp_path / "my photos")
    prompts = ["a watercolour fox", "a red boat at dawn"]
    page.goto(backend_server + "/#/new")
    page.wait_for_function(
        "document.getElementById('preset-select').value === 'default'"
        " && document.getElementById('field-max_steps').value !== ''"
    )
    page.fill("#pipeline-path", str(flux_folder))
    page.click("#inspect-pipeline")
    page.click("#use-pipeline")  # enabled once the inspection says the folder is trainable
    page.fill("#field-data", str(images))
    page.fill("#field-prompts", "\n".join(prompts))
    page.fill("#field-max_steps", "2")  # seconds, not the demo's 160 steps
    page.fill("#run-name", "fox on my photos")
    picture(page, "new-run-my-data", full_page=True)
    page.click("#start-run")
    page.wait_for_url(re.compile(r"#/runs/\d+$"))
    run_id = int(page.url.rsplit("/", 1)[1])

    page.wait_for_function(
        "(document.getElementById('loss')?.data?.[0]?.x ?? []).length >= 1", timeout=180_000
    )
    run = api.wait_run(run_id, {"succeeded", "failed", "crashed"}, timeout=240)
    assert run["status"] == "succeeded", run.get("error")
    assert run["config"]["data"] == {"path": str(images)}
    scans = api.call("GET", f"/api/runs/{run_id}/telemetry?source=trainer&kind=dataset_scan")
    assert [(s["folder"], s["usable"]) for s in scans["data"]] == [(str(images), 6)]
    page.wait_for_function(
        "document.querySelectorAll('#samples figcaption').length === 2", timeout=60_000
    )
    assert page.eval_on_selector_all("#samples figcaption", "fs => fs.map(f => f.textContent)") == (
        prompts
    )
    picture(page, "run-my-data", full_page=True)

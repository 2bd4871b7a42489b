"""A run started from a pipeline folder on the New run page: the folder is inspected (family,
components, streamed blocks) through ``POST /api/pipelines/inspect``, used as ``model.path``, and
the real ``workbench train`` worker trains the tiny FluxPipeline to the end."""

from __future__ import annotations

import json
import re

import pytest

from tests.frontend.conftest import Api, picture

pytestmark = [pytest.mark.browser]


@pytest.fixture(scope="module")
def flux_folder(tmp_path_factory):
    from tests.fixtures.pipelines import build_pipeline

    return build_pipeline("flux", tmp_path_factory.mktemp("pipelines"))


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
    assert config["model"]["path"] == str(flux_folder) and config["model"]["factory"] is None
    assert config["model"]["expert"] is None and page.is_hidden("#pipeline-expert")
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

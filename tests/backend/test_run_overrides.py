"""A run of a preset on the user's own folders through ``POST /api/runs`` (in-process app, no
worker): a data folder drops the preset's data fields bound to it, null removes a key, every
conflict is listed at once naming its field, a value no branch of a union takes is one problem,
and a run without a name is named after its folders."""

from __future__ import annotations

import pytest
from backend_helpers import assert_error_body

from tests.fixtures.images import captioned_images
from workbench.api.deps import get_assets

PROMPTS = ["a watercolour fox", "a red boat at dawn"]


class NoAssetsNeeded:
    """The demo-asset build answering that every run may start: the demo model of ``default``
    is minutes of CPU to build, and what is tested here is the config, not the model."""

    def refusal(self, config, status=None):
        return None


@pytest.fixture
def images(tmp_path):
    return captioned_images(tmp_path / "my images", count=4)


@pytest.fixture
def client(api):
    api.app.dependency_overrides[get_assets] = NoAssetsNeeded
    return api


def test_a_data_folder_on_default_drops_its_data_keys_and_takes_the_prompts(client, images):
    body = {
        "preset": "default",
        "overrides": {"data": {"path": str(images)}, "samples": {"prompts": PROMPTS}},
    }
    # Before: 422 "data.factory: only one of path and factory", then data.limit, then
    # data.max_caption_tokens once each was removed by hand.
    r = client.post("/api/runs", json=body)
    assert r.status_code == 201, r.text
    config = r.json()["config"]
    assert config["data"] == {"path": str(images)}  # no factory, limit 512 or 16 tokens
    assert config["samples"] == {"prompts": PROMPTS, "steps": 8, "every": 40}
    assert config["model"]["factory"] == "flux"  # the model is the preset's: not a data field
    assert r.json()["name"] == f"default on my images-{r.json()['id']}"

    scan = client.post("/api/data/scan", json=body)
    assert scan.status_code == 200, scan.text
    assert (scan.json()["folder"], scan.json()["usable"]) == (str(images), 4)

    # The preset's data fields given by the run stay: the folder drops the preset's only.
    body["overrides"]["data"]["max_caption_tokens"] = 24
    again = client.post("/api/runs", json=body).json()["config"]
    assert again["data"] == {"path": str(images), "max_caption_tokens": 24}


def test_the_folders_and_the_fields_they_drop_are_served(client):
    bound = client.get("/api/overrides/folders").json()["bound"]
    assert set(bound["data.path"]) == {
        "data.factory",
        "data.limit",
        "data.frames",
        "data.max_caption_tokens",
        "samples.prompts",
    }
    assert set(bound["model.path"]) == {"model.factory", "model.size", "model.pretrained"}


def test_null_removes_a_key_of_the_preset(client, images, tmp_path):
    model = tmp_path / "wan"
    model.mkdir()
    wan = {
        "preset": "wan21-14b-24gb",
        "overrides": {
            "model": {"path": str(model)},
            "data": {"path": str(images), "frames": None, "max_caption_tokens": None},
        },
    }
    # Before: "data.max_caption_tokens: found null, expected a valid integer".
    r = client.post("/api/runs", json=wan)
    assert r.status_code == 201, r.text
    data = r.json()["config"]["data"]
    assert "max_caption_tokens" not in data and "frames" not in data
    assert data["bucketing"] is True  # the rest of the preset's data section stays

    # A field that takes null as a value keeps it: no clipping, not the default 1.0.
    clip = client.post("/api/runs", json={"preset": "tiny-ci", "overrides": {"grad_clip": None}})
    assert clip.status_code == 201 and clip.json()["config"]["grad_clip"] is None


def test_every_conflict_is_listed_at_once_each_at_its_field(client, images, tmp_path):
    r = client.post(
        "/api/runs",
        json={"preset": "default", "overrides": {"lora_rank": 8, "lora_alpha": 4}},
    )
    body = assert_error_body(r, 422)
    # Before: lora_rank alone; lora_alpha came after it was fixed.
    assert [d["field"] for d in body["details"]] == ["overrides.lora_rank", "overrides.lora_alpha"]
    assert "null removes the other" in body["details"][0]["message"]

    both = {
        "model": {"path": str(tmp_path), "factory": "flux"},
        "data": {"path": str(images), "factory": "digits"},
    }
    r = client.post("/api/runs", json={"preset": "default", "overrides": both})
    details = assert_error_body(r, 422)["details"]
    # Before: the model's at "overrides.model", naming no field.
    assert sorted(d["field"] for d in details) == [
        "overrides.data.factory",
        "overrides.model.factory",
    ]
    assert all('null removes "factory"' in d["message"] for d in details)


def test_a_value_no_branch_takes_is_one_problem_listing_the_branches(client):
    over = {"memory": {"stagehand": {"vram_high_watermark_mb": -1}}}
    r = client.post("/api/runs", json={"preset": "tiny-ci", "overrides": over})
    body = assert_error_body(r, 422)
    # Before: two details, the second "found -1, expected 'auto'".
    assert [d["message"] for d in body["details"]] == [
        "found -1, expected greater than or equal to 0, or 'auto'"
    ]

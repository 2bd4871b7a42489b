"""A run's overrides applied to its preset (``workbench.contract.preset.overrides.apply_overrides``): which
fields a folder drops, when it drops none, and what null does."""

import copy
import json

from workbench.contract.preset import PRESETS_DIR, apply_overrides


def preset(name: str) -> dict:
    return json.loads((PRESETS_DIR / f"{name}.json").read_text())


def test_a_folder_drops_the_fields_of_the_presets_own_model_and_data_only():
    default = preset("default")
    kept = copy.deepcopy(default)
    over = {"model": {"path": "/m"}, "data": {"path": "/d", "limit": 3}}
    config = apply_overrides(default, over)
    assert default == kept and over == {"model": {"path": "/m"}, "data": {"path": "/d", "limit": 3}}
    assert config["model"] == {
        "path": "/m",
        "dtype": "float32",
        "text_encoder_model_name": "minilm",
    }
    assert config["data"] == {"path": "/d", "limit": 3}  # the run's own limit stays
    assert "prompts" not in config["samples"] and config["samples"]["every"] == 40
    # A preset that names folders of its own wrote its data fields for any folder: FLUX.1-dev's
    # 512 T5 tokens stay when the run names its images.
    flux = apply_overrides(preset("flux-dev-24gb"), {"data": {"path": "/mine"}})
    assert flux["data"] == {"path": "/mine", "bucketing": True, "max_caption_tokens": 512}
    assert flux["samples"]["prompts"] == ["a photo of sks dog on a beach"]


def test_null_removes_a_key_unless_null_is_a_value_other_than_the_default_or_unknown():
    config = apply_overrides(
        preset("tiny-ci"),
        {
            "max_steps": None,
            "data": {"max_caption_tokens": None, "limit": None},
            "grad_clip": None,
            "memory": {"stagehand": {"activation_stagehand": None, "nonsense": None}},
            "samples": {"every": None, "steps": None},
        },
    )
    assert "max_steps" not in config and config["data"] == {"factory": "digits"}
    assert config["grad_clip"] is None  # null is a value there: no clipping, not 1.0
    stagehand = config["memory"]["stagehand"]
    assert "activation_stagehand" not in stagehand and stagehand["nonsense"] is None
    assert config["samples"] == {}  # a section the preset lacks, made

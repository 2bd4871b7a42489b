"""Preset schema: shipped presets, the seeds' configuration blocks verbatim, path-named errors."""

import json

import pytest

from workbench.contract.preset import PRESETS_DIR, Preset, PresetError
from workbench.worker.preset import list_presets, load_preset, validate_preset

# Copied from the LTX-2 bf16 on 24 GB case study (verbatim).
LTX2_SEED = """{
"model_type": "ltx2",
"training_method": "lora",
"model": {
"path": "/path/to/LTX-2/",
"dtype": "bfloat16",
"text_encoder_model_name": "/path/to/gemma-3-12b-it"
},
"adapter": { "rank": 32, "alpha": 32 },
"memory": {
"gradient_checkpointing": "on",
"strategy": "stagehand",
"stagehand": {
"two_stage": true,
"text_encoder_block_swap": true,
"encoder_family": "gemma3",
"family": "ltx2",
"pinned_pool_mb": 8192,
"pinned_slab_mb": 1024,
"vram_high_watermark_mb": 20000,
"vram_low_watermark_mb": 16000,
"prefetch_window_blocks": 2,
"max_inflight_transfers": 2
}
},
"resolution": 512,
"batch_size": 1,
"data": { "frames": 17 }
}"""

# Copied from the Flux 2048 px layer-offload case study (verbatim).
FLUX2048_SEED = """{
"model_type": "flux_dev",
"training_method": "lora",
"lora_rank": 16,
"lora_alpha": 16.0,
"model": {
"path": "black-forest-labs/FLUX.1-dev",
"dtype": "bfloat16"
},
"memory": {
"gradient_checkpointing": "on",
"enable_activation_offloading": true,
"enable_async_offloading": true,
"layer_offload_fraction": 0.9
},
"optimizer": { "optimizer": "adamw", "weight_decay": 0.01 },
"scheduler": { "scheduler": "constant", "warmup_steps": 0 },
"timestep_distribution": "logit_normal",
"learning_rate": 0.0004,
"resolution": 2048,
"batch_size": 1,
"max_steps": 50,
"train_dtype": "bfloat16"
}"""

# Copied from "Activation Stagehand" (verbatim; it is a whole-config fragment).
ACTIVATION_SEED = """{
  "memory": {
    "strategy": "stagehand",
    "stagehand": {
      "activation_stagehand": {
        "enabled": true,
        "vram_high_watermark_mb": 16000,
        "vram_low_watermark_mb": 12000,
        "pinned_pool_classes_mb": [1, 4, 16, 64, 256],
        "slabs_per_class": [512, 2, 2, 2, 2],
        "max_inflight_d2h": 1,
        "max_inflight_h2d": 1,
        "debug_checksums": false,
        "telemetry_enabled": true,
        "telemetry_file": "activation_telemetry.jsonl"
      }
    }
  }
}"""

# Copied from "Conductor: Resource Arbitration Across Memory Runtimes" (verbatim).
CONDUCTOR_SEED = """{
  "memory": {
    "stagehand": {
      "conductor_config": {
        "enabled": true,
        "vram_soft_cap_mb": 22000,
        "vram_hard_cap_mb": 23500,
        "h2d_slots": 2,
        "d2h_slots": 2
      }
    }
  }
}"""

MODEL = {"model": {"factory": "flux", "size": "tiny"}}


def test_every_shipped_preset_validates():
    names = list_presets()
    for required in (
        "default",
        "tiny-ci",
        "ltx2-24gb",
        "flux-2048-layer-offload",
        "activation-spill-16000-12000",
        "conductor-22000-23500",
    ):
        assert required in names
    for name in names:
        loaded_name, raw = load_preset(name)
        preset = validate_preset(raw)
        assert loaded_name == name and preset.name == name
        assert preset.max_steps > 0


def test_ltx2_seed_block_verbatim():
    p = validate_preset(json.loads(LTX2_SEED))
    assert (p.family, p.rank, p.alpha) == ("ltx2", 32, 32.0)
    assert p.memory.strategy == "stagehand" and p.memory.gradient_checkpointing is True
    sh = p.memory.stagehand
    assert (sh.pinned_pool_mb, sh.pinned_slab_mb, sh.prefetch_window_blocks) == (8192, 1024, 2)
    assert (sh.vram_high_watermark_mb, sh.vram_low_watermark_mb) == (20000, 16000)
    # The seed's fields no part of a run reads load and are dropped (RETIRED_STAGEHAND_FIELDS).
    assert sh.text_encoder_block_swap
    assert not {"two_stage", "encoder_family", "family"} & set(sh.model_dump())
    assert p.data.frames == 17 and p.text_encoder_path == "/path/to/gemma-3-12b-it"


def test_flux2048_seed_block_verbatim():
    p = validate_preset(json.loads(FLUX2048_SEED))
    assert (p.family, p.rank, p.alpha, p.learning_rate) == ("flux", 16, 16.0, 0.0004)
    # The seed names no strategy; its layer-offload fields select it.
    assert p.memory.strategy == "layer_offload"
    assert p.memory.layer_offload_fraction == 0.9 and p.memory.enable_async_offloading
    assert p.optimizer.weight_decay == 0.01 and p.timestep_distribution == "logit_normal"
    assert (p.resolution, p.max_steps, p.train_dtype) == (2048, 50, "bfloat16")


def test_activation_and_conductor_seed_blocks_verbatim():
    act = validate_preset({**MODEL, **json.loads(ACTIVATION_SEED)})
    a = act.memory.stagehand.activation_stagehand
    assert (a.vram_high_watermark_mb, a.vram_low_watermark_mb) == (16000, 12000)
    assert a.slab_counts() == (512, 2, 2, 2, 2)
    cond = validate_preset({**MODEL, **json.loads(CONDUCTOR_SEED)})
    c = cond.memory.stagehand.conductor_config
    assert cond.memory.strategy == "stagehand"
    assert (c.enabled, c.vram_soft_cap_mb, c.vram_hard_cap_mb, c.h2d_slots) == (
        True,
        22000,
        23500,
        2,
    )


def _problems(data):
    with pytest.raises(PresetError) as info:
        validate_preset(data)
    return {p["path"]: p for p in info.value.problems}, str(info.value)


def test_unknown_field_is_named_by_path():
    probs, text = _problems({**MODEL, "memory": {"stagehand": {"prefetch_window": 2}}})
    assert "memory.stagehand.prefetch_window" in probs
    assert "memory.stagehand.prefetch_window: found 2, expected no such field" in text


def test_wrong_type_names_path_value_and_expectation():
    probs, text = _problems({**MODEL, "batch_size": "four", "adapter": {"rank": 1.5}})
    assert probs["batch_size"]["found"] == "'four'"
    assert "valid integer" in probs["batch_size"]["expected"]
    assert "adapter.rank" in probs


def test_layer_offload_fraction_out_of_range():
    probs, text = _problems({**MODEL, "memory": {"layer_offload_fraction": 1.5}})
    assert list(probs) == ["memory.layer_offload_fraction"]
    assert "memory.layer_offload_fraction: found 1.5, expected less than or equal to 1" in text


def test_union_branches_do_not_leak_into_paths():
    bad = {"stagehand": {"activation_stagehand": {"slabs_per_class": "many"}}}
    probs, _ = _problems({**MODEL, "memory": {"strategy": "stagehand", **bad}})
    assert set(probs) == {"memory.stagehand.activation_stagehand.slabs_per_class"}


def test_conflicting_rank_spellings_rejected_and_equal_ones_accepted():
    _, text = _problems({**MODEL, "lora_rank": 8, "adapter": {"rank": 4}})
    assert "lora_rank (8) and adapter.rank (4) disagree" in text
    p = validate_preset({**MODEL, "lora_rank": 8, "adapter": {"rank": 8, "alpha": 4}})
    assert (p.rank, p.alpha) == (8, 4.0)


def test_model_needs_exactly_one_source_and_known_type():
    probs, _ = _problems({"model": {"dtype": "float32"}})
    assert "model" in probs
    _, text = _problems({**MODEL, "model_type": "unet9"})
    assert "model_type: found 'unet9', expected one of flux, flux_dev" in text


def test_check_paths_names_missing_folders(tmp_path):
    p = validate_preset(json.loads(LTX2_SEED))  # placeholder paths validate...
    with pytest.raises(PresetError) as info:
        p.check_paths()  # ...but not when training starts
    paths = {x["path"] for x in info.value.problems}
    assert {"model.path", "model.text_encoder_model_name", "data"} <= paths
    ok = validate_preset({"model": {"path": str(tmp_path)}, "data": {"path": str(tmp_path)}})
    ok.check_paths()


def test_numbers_are_strict_json_numbers_and_finite():
    probs, _ = _problems(
        {
            **MODEL,
            "learning_rate": True,
            "batch_size": "4",
            "max_steps": 8.5,
            "logit_mean": float("nan"),
            "logit_std": float("inf"),
            "memory": {"stagehand": {"vram_high_watermark_mb": float("-inf")}},
        }
    )
    assert probs["learning_rate"]["found"] == "true"
    assert probs["learning_rate"]["expected"] == "a valid number"
    assert probs["batch_size"]["found"] == "'4'"
    assert probs["max_steps"]["expected"] == "a valid integer"
    assert (probs["logit_mean"]["found"], probs["logit_std"]["found"]) == ("NaN", "Infinity")
    assert probs["logit_mean"]["expected"] == "a finite number"
    assert probs["memory.stagehand.vram_high_watermark_mb"]["found"] == "-Infinity"
    # Whole numbers still fill float fields, JSON arrays still fill tuples.
    p = validate_preset({**MODEL, "learning_rate": 1, "optimizer": {"betas": [0.8, 0.9]}})
    assert (p.learning_rate, p.optimizer.betas) == (1.0, (0.8, 0.9))


def test_sizes_have_upper_bounds_named_in_the_error():
    probs, text = _problems(
        {
            **MODEL,
            "resolution": 100000,
            "batch_size": 100000,
            "lora_rank": 10**6,
            "adapter": {"rank": 10**6},
            "max_steps": 10**30,
            "data": {"frames": 5000, "max_caption_tokens": 10**5},
        }
    )
    assert "resolution: found 100000, expected less than or equal to 4096" in text
    assert "batch_size: found 100000, expected less than or equal to 256" in text
    assert probs["lora_rank"]["expected"] == probs["adapter.rank"]["expected"]
    assert probs["lora_rank"]["expected"] == "less than or equal to 1024"
    assert probs["max_steps"]["expected"] == "less than or equal to 10000000"
    assert probs["data.frames"]["expected"] == "less than or equal to 1024"
    assert probs["data.max_caption_tokens"]["expected"] == "less than or equal to 4096"
    _, text = _problems({**MODEL, "data": {"path": "x" * 5000}})
    assert "data.path: found 'xxx" in text and "expected at most 4096 characters" in text


def test_rules_between_fields_name_the_field_with_a_sentence():
    probs, text = _problems({**MODEL, "memory": {"stagehand": {"vram_high_watermark_mb": 100}}})
    assert list(probs) == ["memory.stagehand.vram_low_watermark_mb"]
    assert probs["memory.stagehand.vram_low_watermark_mb"]["found"] == "16000.0"
    assert (
        "memory.stagehand.vram_low_watermark_mb: vram_low_watermark_mb (16000.0) must not be "
        "above vram_high_watermark_mb (100.0)"
    ) in text
    caps = {"conductor_config": {"vram_soft_cap_mb": 5, "vram_hard_cap_mb": 4}}
    probs, _ = _problems({**MODEL, "memory": {"stagehand": caps}})
    assert list(probs) == ["memory.stagehand.conductor_config.vram_soft_cap_mb"]
    spill = {"activation_stagehand": {"vram_low_watermark_mb": 30000}}
    probs, _ = _problems({**MODEL, "memory": {"stagehand": spill}})
    assert list(probs) == ["memory.stagehand.activation_stagehand.vram_low_watermark_mb"]
    probs, text = _problems({**MODEL, "lora_rank": 8, "adapter": {"rank": 4}})
    assert list(probs) == ["lora_rank"] and "lora_rank: lora_rank (8) and adapter.rank" in text
    probs, _ = _problems({**MODEL, "data": {"path": "/x", "factory": "digits"}})
    assert list(probs) == ["data.factory"]
    probs, _ = _problems({**MODEL, "prediction_type": "v_prediction"})
    assert list(probs) == ["prediction_type"]


def test_caption_suffix_is_an_extension_not_a_path():
    for bad in ("../../etc/passwd", "a/b", "", "t" * 17, ".."):
        probs, _ = _problems({**MODEL, "data": {"captions": bad}})
        assert "not a path" in probs["data.captions"]["expected"], bad
    ok = validate_preset({**MODEL, "data": {"captions": ".caption"}})
    assert ok.data.captions == ".caption"


def test_data_background_colour_and_bad_file_policy():
    probs, _ = _problems({**MODEL, "data": {"background": "transparent-ish", "on_bad_file": "x"}})
    assert probs["data.background"]["expected"] == "a colour name (white, black) or #rrggbb"
    assert probs["data.on_bad_file"]["expected"] == "'skip' or 'fail'"
    ok = validate_preset({**MODEL, "data": {"background": "#102030", "on_bad_file": "fail"}})
    assert (ok.data.background_rgb, ok.data.on_bad_file) == ((16, 32, 48), "fail")
    default = validate_preset(MODEL).data
    assert (default.background_rgb, default.on_bad_file) == ((255, 255, 255), "skip")
    assert default.default_caption is None


def test_check_paths_names_a_path_the_system_cannot_take(tmp_path):
    p = validate_preset({**MODEL, "data": {"path": str(tmp_path / ("n" * 300))}})
    with pytest.raises(PresetError) as info:
        p.check_paths()
    (problem,) = info.value.problems
    assert problem["path"] == "data.path" and "File name too long" in problem["expected"]


def test_check_paths_for_the_api_wants_absolute_folders(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "images").mkdir()
    p = validate_preset({**MODEL, "data": {"path": "images"}})
    p.check_paths()  # the worker's own command line: relative to where it runs
    with pytest.raises(PresetError) as info:
        p.check_paths(absolute=True)
    (problem,) = info.value.problems
    assert problem["path"] == "data.path" and problem["found"] == "'images'"
    assert problem["expected"].startswith("an absolute folder path")
    validate_preset({**MODEL, "data": {"path": str(tmp_path / "images")}}).check_paths(True)


def test_preset_module_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys, workbench.worker.preset; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_load_preset_unknown_name_lists_builtins():
    with pytest.raises(FileNotFoundError, match="tiny-ci"):
        load_preset("no-such-preset")
    assert PRESETS_DIR.is_dir() and isinstance(Preset.model_fields, dict)

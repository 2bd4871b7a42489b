"""The planner plans every family the trainer trains, from configs and safetensors headers.

Tiny pipelines of each family (``tests/fixtures/pipelines.py``) check that the plan feeds the
transformer what a run feeds it (the latents' shape is the real VAE's on real pixels); a
real-size folder whose weights are a sparse file (``tests/fixtures/sparse_pipelines.py``)
checks the figures of a 24 GB preset.
"""

from __future__ import annotations

import json

import pytest
import torch

from stagehand.config.memory import MB
from workbench.cli.plan import main
from workbench.plan import PlanInputError, plan_preset, profile

FAMILIES = ["flux", "qwenimage", "wan", "wan22", "zimage", "ltx2", "sd3", "sdxl", "flux2"]
VIDEO = {"wan": 5, "wan22": 5, "ltx2": 9}
"""Frames of a clip for the video families (4k + 1 for Wan's VAE, 2k + 1 for the tiny LTX-2's)."""


def _preset(folder, family: str, **extra) -> dict:
    data = {"path": "/nowhere", "max_caption_tokens": 32 if family in ("ltx2", "flux2") else 16}
    if family in VIDEO:
        data["frames"] = VIDEO[family]
    model = {"path": str(folder), "dtype": "float32"}
    if family == "wan22":
        model["expert"] = "low_noise"
    return {
        "model": model,
        "resolution": 64,
        "batch_size": 2,
        "memory": {"strategy": "none"},
        "data": data,
        **extra,
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_plans_with_the_trainers_own_shapes(asset_cache, family):
    """Before: ``TypeError: example_inputs: unsupported model class`` for all but Flux, SD3
    and SDXL (and a Flux-shaped guess for those). The latents the plan feeds are the shape
    the folder's real VAE gives for real pixels through the family's ``encode_pixels``."""
    from tests.fixtures.pipelines import build_pipeline
    from workbench.plan.calls import latent_shape
    from workbench.plan.plan import preset_family, preset_model
    from workbench.worker.preset import validate_preset

    folder = build_pipeline(family, asset_cache)
    data = _preset(folder, family)
    plan = plan_preset(data, profile("rtx4090"), name=family)
    preset = validate_preset(data)
    fam = preset_family(preset)
    vae = fam.load_vae(fam.root / "vae")
    frames = (VIDEO[family],) if family in VIDEO else ()
    pixels = torch.rand(2, 3, *frames, 64, 64) * 2 - 1
    with torch.no_grad():
        real = tuple(fam.encode_pixels(vae, pixels).shape)
    assert latent_shape(fam, preset, torch.float32) == real
    inv = plan.inventory
    assert inv.model_class == type(preset_model(preset, fam)).__name__
    assert plan.to_dict()["inputs"]["latents"] == list(real)
    assert len(inv.blocks) >= 2 and inv.lora_bytes > 0
    # Every block computes; blocks before the first adapter save nothing (no gradient there).
    assert all(b.forward_flops > 0 for b in inv.blocks) and inv.blocks[-1].saved_bytes > 0
    assert plan.fits and plan.steady.peak_bytes > inv.param_bytes


def test_plan_shapes_follow_the_preset(asset_cache):
    """Twice the resolution: four times the tokens, so more saved activations per block."""
    from tests.fixtures.pipelines import build_pipeline

    folder = build_pipeline("qwenimage", asset_cache)
    small = plan_preset(_preset(folder, "qwenimage"), profile("rtx4090")).inventory
    large = plan_preset(
        {**_preset(folder, "qwenimage"), "resolution": 128}, profile("rtx4090")
    ).inventory
    assert large.blocks[0].saved_bytes > 2 * small.blocks[0].saved_bytes


@pytest.mark.parametrize(
    ("family", "change", "field"),
    [
        ("wan", {"frames": 4}, "data.frames"),
        ("ltx2", {"max_caption_tokens": 20}, "data.max_caption_tokens"),
    ],
)
def test_bad_family_input_is_exit_2_naming_the_field(
    asset_cache, tmp_path, capsys, family, change, field
):
    from tests.fixtures.pipelines import build_pipeline

    data = _preset(build_pipeline(family, asset_cache), family)
    data["data"].update(change)
    with pytest.raises(PlanInputError, match=field):
        plan_preset(data, profile("rtx4090"))
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**data, "name": "bad"}))
    assert main([str(path), "--device", "rtx4090", "--no-calibration"]) == 2
    assert field in capsys.readouterr().err


def test_single_model_folder_of_a_pipeline_class_names_model_path(asset_cache):
    """A transformer folder alone (no model_index.json) of a class the factory does not know:
    exit 2 asking for the pipeline folder, not a TypeError."""
    from tests.fixtures.pipelines import build_pipeline

    folder = build_pipeline("qwenimage", asset_cache) / "transformer"
    data = {**_preset(folder, "qwenimage")}
    with pytest.raises(PlanInputError, match="model.path: .*pipeline folder"):
        plan_preset(data, profile("rtx4090"))


@pytest.mark.slow
def test_qwen_image_24gb_plans_at_real_size_from_a_sparse_folder(asset_cache, tmp_path, capsys):
    """Qwen-Image's real config with a 38.9 GB safetensors file that is a hole: the plan has
    the preset description's 60 blocks of 648.2 MB (the LoRA stays resident: H2D-only) and 4096 + 1024 tokens."""
    from tests.fixtures.sparse_pipelines import sparse_pipeline
    from workbench.worker.preset import load_preset

    folder = sparse_pipeline("qwenimage", tmp_path / "qwen", asset_cache)
    assert sum(f.stat().st_blocks for f in folder.rglob("*.safetensors")) * 512 < 64 * MB
    _, data = load_preset("qwen-image-24gb")
    data["model"]["path"] = str(folder)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    status = main(
        [str(path), "--device", "rtx4090", "--no-calibration", "--json", str(tmp_path / "o.json")]
    )
    out = json.loads((tmp_path / "o.json").read_text())
    assert status == (0 if out["fits"] else 1)
    assert out["model"]["n_blocks"] == 60
    assert out["model"]["largest_block_bytes"] / MB == pytest.approx(648.2, abs=0.05)
    assert out["inputs"]["latents"] == [1, 16, 128, 128]
    assert out["inputs"]["text"] == [1, 1024, 3584]
    assert "QwenImageTransformer2DModel" in capsys.readouterr().out


def test_a_missing_model_folder_is_named_once(tmp_path, capsys):
    """The 24 GB family presets as shipped (model.path a placeholder): exit 2 with the field
    named once (before: "model.path: model.path: '/path/to/FLUX.1-dev' is not a folder")."""
    data = _preset(tmp_path / "FLUX.1-dev", "flux")
    with pytest.raises(PlanInputError) as err:
        plan_preset(data, profile("rtx4090"))
    assert str(err.value) == f"model.path: {str(tmp_path / 'FLUX.1-dev')!r} is not a folder"
    path = tmp_path / "p.json"
    path.write_text(json.dumps({**data, "name": "missing"}))
    assert main([str(path), "--device", "rtx4090", "--no-calibration"]) == 2
    assert capsys.readouterr().err.count("model.path") == 1

"""SD 3.5 from a pipeline folder, end to end through ``workbench train`` with weight streaming,
activation spill and the Conductor on (tiny StableDiffusion3Pipeline: CLIP-L 3 layers, CLIP-G 5
layers, T5 3 layers, 3 joint blocks, 64x128 images)."""

import json
import math

import pytest
import torch

from tests.worker.conftest import (
    assert_cache_reused,
    assert_streamed_and_spilled,
    stage1_steps,
)
from workbench.worker.outputs import COMFY_FILE


@pytest.fixture(scope="module")
def sd3_run(sd3_pipeline_dir, wide_images, tmp_path_factory, pipe_io):
    tmp = tmp_path_factory.mktemp("sd3-run")
    preset = pipe_io.preset(tmp, sd3_pipeline_dir, wide_images)
    return pipe_io.train_twice(preset, tmp)


def test_sd3_trains_with_every_runtime_on_and_reuses_the_cache(sd3_run, pipe_io):
    records, of = pipe_io.records, pipe_io.of
    first, second = sd3_run
    recs = records(first)
    assert recs[-1]["status"] == "succeeded"
    (found,) = of(recs, "trainer", "pipeline")
    assert found["family"] == "sd3"
    assert [b["name"] for b in found["blocks"]] == [f"transformer_blocks.{i}" for i in range(3)]
    steps = of(recs, "trainer", "step")
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert all(math.isfinite(s["loss"]) for s in steps)
    assert [s["step"] for s in steps if "val_loss" in s] == [2, 4]
    # Stage 1: CLIP-L, CLIP-G, T5, each streamed from its files as an inference step 0.
    stage1 = stage1_steps(recs)
    assert [r["blocks_loaded"] for r in stage1] == [3, 5, 3]
    assert all(r["file_reads"] > 0 for r in stage1)
    messages = [r["message"] for r in of(recs, "trainer", "stage")]
    assert "text_encoder_3 released (3/3)" in messages
    assert_streamed_and_spilled(recs)
    paths = [s["path"] for s in of(recs, "trainer", "sample")]
    assert paths == [  # step 0, every 2 steps, the end
        "samples/step-000000-00.png",
        "samples/step-000002-00.png",
        "samples/sample-00.png",
    ]
    assert_cache_reused(second, steps)
    assert not (first / "lora" / COMFY_FILE).exists()  # no converter reads ComfyUI's SD3 names


def test_sd3_lora_loads_into_the_pipeline_and_changes_it(sd3_run, sd3_pipeline_dir):
    from diffusers import StableDiffusion3Pipeline
    from safetensors import safe_open

    run_dir, _ = sd3_run
    lora = run_dir / "lora"
    with safe_open(str(lora / "pytorch_lora_weights.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["stagehand.family"] == "sd3"
    assert len(json.loads(meta["stagehand.targets"])) == 8  # train_dreambooth_lora_sd3.py's

    pipe = StableDiffusion3Pipeline.from_pretrained(sd3_pipeline_dir, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)

    def generate():
        return pipe(
            "a photo of the digit seven",
            height=64,
            width=128,
            num_inference_steps=2,
            guidance_scale=1.0,
            max_sequence_length=16,
            generator=torch.Generator().manual_seed(0),
            output_type="pt",
        ).images

    base = generate()
    pipe.load_lora_weights(lora)
    tuned = generate()
    assert tuned.shape == (1, 3, 64, 128) and (tuned - base).abs().max() > 1e-4


def test_sd3_text_and_predict_are_the_pipelines(sd3_run, sd3_pipeline_dir, tmp_path):
    """The cached text is ``encode_prompt``'s, and one Euler step of ``__call__`` from sigma 1
    is x - predict(x, 1) (the static shift of 3 is the scheduler's)."""
    from diffusers import StableDiffusion3Pipeline
    from safetensors.torch import load_file

    from workbench.worker.families import Text
    from workbench.worker.pipelines import adapter_for, inspect_pipeline

    adapter = adapter_for(inspect_pipeline(sd3_pipeline_dir), tmp_path, torch.float32)
    pipe = StableDiffusion3Pipeline.from_pretrained(sd3_pipeline_dir, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    hidden, _, pooled, _ = pipe.encode_prompt(
        "a photo of the digit seven", None, None, do_classifier_free_guidance=False,
        max_sequence_length=16,
    )  # fmt: skip
    (cached,) = (sd3_run[0].parent / "cache" / "trainer-cache").glob("text-*")
    text = load_file(str(cached))
    assert text["hidden"].shape == (7, 77 + 16, 56) and text["pooled"].shape == (7, 26)
    assert torch.allclose(text["hidden"][-1], hidden[0], atol=1e-6)
    assert torch.allclose(text["pooled"][-1], pooled[0], atol=1e-6)

    x = torch.randn(1, 4, 6, 10, generator=torch.Generator().manual_seed(3))  # (B, C, h, w)
    out = pipe(
        prompt_embeds=hidden,
        pooled_prompt_embeds=pooled,
        latents=x,
        height=6 * pipe.vae_scale_factor,
        width=10 * pipe.vae_scale_factor,
        num_inference_steps=1,
        guidance_scale=1.0,
        output_type="latent",
    ).images
    with torch.no_grad():
        v = adapter.predict(pipe.transformer, x, torch.ones(1), Text(hidden, None, pooled))
    assert torch.allclose(out, x - v, atol=1e-5) and (v.abs() > 0).any()
    u = torch.tensor([0.2, 0.5, 0.8])
    assert torch.allclose(adapter.shift_sigmas(u, x.shape), 3 * u / (1 + 2 * u))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "joint_attention_dim",
            64,
            r"joint_attention_dim is 64 but text_encoder_3/config.json d_mo",
        ),
        (
            "pooled_projection_dim",
            20,
            r"pooled_projection_dim is 20; expected text_encoder \+ text_",
        ),
        ("in_channels", 16, r"in_channels is 16; expected vae latent_channels \(4\)"),
    ],
)
def test_sd3_transformer_that_does_not_fit_is_named(
    sd3_pipeline_dir, tmp_path, field, value, message
):
    import shutil

    from workbench.worker.pipelines import PipelineFolderError, adapter_for, inspect_pipeline

    folder = shutil.copytree(sd3_pipeline_dir, tmp_path / "copy")
    config = json.loads((folder / "transformer" / "config.json").read_text())
    (folder / "transformer" / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(PipelineFolderError, match=message) as err:
        adapter_for(inspect_pipeline(folder), tmp_path, torch.float32)
    assert f"{folder}/transformer/config.json: does not fit the sd3 pipeline" in str(err.value)


def test_sd3_resumes_from_its_checkpoint_with_the_same_adapter_and_losses(sd3_run, pipe_io):
    """SD 3.5 killed after step 3 resumes from its own config.json and step-2 checkpoint."""
    pipe_io.assert_resumes(sd3_run[0])

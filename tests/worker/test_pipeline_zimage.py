"""Z-Image from a pipeline folder, end to end through ``workbench train`` with weight
streaming, activation spill and the Conductor on (tiny ZImagePipeline: Qwen3 text model of 3
layers, 3 transformer layers and two refiners, 64x128 images)."""

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
def zimage_run(zimage_pipeline_dir, wide_images, tmp_path_factory, pipe_io):
    tmp = tmp_path_factory.mktemp("zimage-run")
    preset = pipe_io.preset(tmp, zimage_pipeline_dir, wide_images, adapter={"rank": 4, "alpha": 8})
    return pipe_io.train_twice(preset, tmp)


def test_zimage_trains_with_every_runtime_on_and_reuses_the_cache(zimage_run, pipe_io):
    records, of = pipe_io.records, pipe_io.of
    first, second = zimage_run
    recs = records(first)
    assert recs[-1]["status"] == "succeeded"
    steps = of(recs, "trainer", "step")
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert all(math.isfinite(s["loss"]) for s in steps)
    assert [s["step"] for s in steps if "val_loss" in s] == [2, 4]
    stage1 = stage1_steps(recs)
    assert len(stage1) == 1 and stage1[0]["blocks_loaded"] == 3 and stage1[0]["file_reads"] > 0
    assert_streamed_and_spilled(recs)
    paths = [s["path"] for s in of(recs, "trainer", "sample")]
    assert paths == [f"samples/{n}-00.png" for n in ("step-000000", "step-000002", "sample")]
    assert_cache_reused(second, steps)


def test_zimage_lora_and_its_comfyui_copy_load_and_agree(zimage_run, zimage_pipeline_dir):
    from diffusers import ZImagePipeline
    from safetensors import safe_open
    from safetensors.torch import load_file

    run_dir, _ = zimage_run
    lora = run_dir / "lora"
    comfy = load_file(str(lora / COMFY_FILE))
    assert "diffusion_model.layers.0.attention.to_q.lora_A.weight" in comfy
    assert not any(k.endswith(".alpha") for k in comfy)  # alpha 8 / rank 4 folded into B
    with safe_open(str(lora / "pytorch_lora_weights.safetensors"), "pt") as f:
        targets = json.loads(f.metadata()["stagehand.targets"])
    assert "feed_forward.w1" in targets and "to_out.0" in targets

    pipe = ZImagePipeline.from_pretrained(zimage_pipeline_dir, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)

    def generate():
        return pipe(
            "a photo of the digit seven",
            height=64,
            width=128,
            num_inference_steps=2,
            guidance_scale=0.0,
            max_sequence_length=32,
            generator=torch.Generator().manual_seed(0),
            output_type="pt",
        ).images

    base = generate()
    pipe.load_lora_weights(lora, adapter_name="diffusers")
    tuned = generate()
    assert tuned.shape == (1, 3, 64, 128) and (tuned - base).abs().max() > 1e-4
    pipe.delete_adapters("diffusers")
    pipe.load_lora_weights(lora, weight_name=COMFY_FILE, adapter_name="comfyui")
    assert torch.allclose(generate(), tuned, atol=1e-6)


def test_zimage_predict_is_one_euler_step_of_the_pipeline(zimage_pipeline_dir, tmp_path):
    """``__call__`` passes 1 - sigma and negates the output: one step from sigma 1 is
    x - predict(x, 1); the static shift of 3 is the scheduler's."""
    from diffusers import ZImagePipeline

    from workbench.worker.families import Text
    from workbench.worker.pipelines import adapter_for, inspect_pipeline

    adapter = adapter_for(inspect_pipeline(zimage_pipeline_dir), tmp_path, torch.float32)
    pipe = ZImagePipeline.from_pretrained(zimage_pipeline_dir, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    embeds = pipe._encode_prompt(["a photo of the digit one"], max_sequence_length=32)
    x = torch.randn(1, 4, 6, 10, generator=torch.Generator().manual_seed(3))  # (B, C, h, w)
    out = pipe(
        prompt_embeds=embeds,
        latents=x,
        height=6 * pipe.vae_scale_factor,
        width=10 * pipe.vae_scale_factor,
        num_inference_steps=1,
        guidance_scale=0.0,
        output_type="latent",
    ).images
    hidden = embeds[0][None]
    text = Text(hidden, torch.ones(1, hidden.shape[1]), hidden[:, 0, :0])
    with torch.no_grad():
        v = adapter.predict(pipe.transformer, x, torch.ones(1), text)
    assert torch.allclose(out, x - v, atol=1e-5) and (v.abs() > 0).any()
    u = torch.tensor([0.2, 0.5, 0.8])
    assert torch.allclose(adapter.shift_sigmas(u, x.shape), 3 * u / (1 + 2 * u))


def test_zimage_resumes_from_its_checkpoint_with_the_same_adapter_and_losses(zimage_run, pipe_io):
    """Z-Image killed after step 3 resumes from its own config.json and step-2 checkpoint."""
    pipe_io.assert_resumes(zimage_run[0])

"""Qwen-Image from a pipeline folder, end to end through ``workbench train`` with weight
streaming, activation spill and the Conductor on (tiny QwenImagePipeline: Qwen2.5-VL text
model of 3 layers, 3 transformer blocks, z_dim 4 VAE, 64x128 images)."""

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
def qwen_run(qwenimage_pipeline_dir, wide_images, tmp_path_factory, pipe_io):
    """Two runs on one cache; rank 4, alpha 8 (a LoRA scale of 2 the copies must carry)."""
    tmp = tmp_path_factory.mktemp("qwen-run")
    preset = pipe_io.preset(
        tmp, qwenimage_pipeline_dir, wide_images, adapter={"rank": 4, "alpha": 8}
    )
    return pipe_io.train_twice(preset, tmp)


def test_qwenimage_trains_with_every_runtime_on_and_reuses_the_cache(qwen_run, pipe_io):
    records, of = pipe_io.records, pipe_io.of
    first, second = qwen_run
    recs = records(first)
    assert recs[-1]["status"] == "succeeded"
    steps = of(recs, "trainer", "step")
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert all(math.isfinite(s["loss"]) for s in steps)
    assert [s["step"] for s in steps if "val_loss" in s] == [2, 4]
    stage1 = stage1_steps(recs)
    # One encoder, its 3 language-model layers block-swapped. From host memory, not the files:
    # transformers 5 saves Qwen2.5-VL under its old names (model.layers.N), the runtime looks
    # for model.language_model.layers.N and keeps unmatched weights module-backed.
    assert len(stage1) == 1 and stage1[0]["blocks_loaded"] == 3
    assert_streamed_and_spilled(recs)
    paths = [s["path"] for s in of(recs, "trainer", "sample")]
    assert paths == [f"samples/{n}-00.png" for n in ("step-000000", "step-000002", "sample")]
    assert_cache_reused(second, steps)


def test_qwenimage_lora_and_its_comfyui_copy_load_and_agree(qwen_run, qwenimage_pipeline_dir):
    from diffusers import QwenImagePipeline
    from safetensors import safe_open
    from safetensors.torch import load_file

    run_dir, _ = qwen_run
    lora = run_dir / "lora"
    comfy = load_file(str(lora / COMFY_FILE))
    assert all(k.startswith("diffusion_model.transformer_blocks.") for k in comfy)
    name = "diffusion_model.transformer_blocks.0.attn.to_q"
    assert comfy[f"{name}.lora_A.weight"].shape[0] == 4
    assert not any(k.endswith(".alpha") for k in comfy)  # alpha 8 / rank 4 folded into B
    with safe_open(str(lora / "pytorch_lora_weights.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["stagehand.family"] == "qwenimage" and meta["stagehand.alpha"] == "8.0"
    assert json.loads(meta["stagehand.targets"]) == ["to_k", "to_out.0", "to_q", "to_v"]

    pipe = QwenImagePipeline.from_pretrained(qwenimage_pipeline_dir, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)

    def generate():
        return pipe(
            "a photo of the digit seven",
            height=64,
            width=128,
            num_inference_steps=2,
            true_cfg_scale=1.0,
            generator=torch.Generator().manual_seed(0),
            output_type="pt",
        ).images

    base = generate()
    pipe.load_lora_weights(lora, adapter_name="diffusers")
    tuned = generate()
    assert (tuned - base).abs().max() > 1e-4
    pipe.delete_adapters("diffusers")
    assert torch.equal(generate(), base)
    pipe.load_lora_weights(lora, weight_name=COMFY_FILE, adapter_name="comfyui")
    assert torch.allclose(generate(), tuned, atol=1e-6)


def test_qwenimage_parts_match_the_pipeline(qwenimage_pipeline_dir, tmp_path):
    """The template is 34 tokens; predict is one Euler step of ``__call__``; the latent
    normalisation is what ``__call__`` inverts; a transformer that does not fit is named."""
    from diffusers import QwenImagePipeline

    from tests.fixtures.tiny_tokenizers import QWEN_TEMPLATE
    from workbench.worker.families import Text
    from workbench.worker.pipelines import PipelineFolderError, adapter_for, inspect_pipeline

    info = inspect_pipeline(qwenimage_pipeline_dir)
    assert info.family == "qwenimage"
    assert [b.name for b in info.blocks] == [f"transformer_blocks.{i}" for i in range(3)]
    adapter = adapter_for(info, tmp_path, torch.float32)
    pipe = QwenImagePipeline.from_pretrained(qwenimage_pipeline_dir, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    prefix = QWEN_TEMPLATE.split("{}")[0]
    assert len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 34

    embeds, mask = pipe._get_qwen_prompt_embeds(["a photo of the digit one"])
    x = torch.randn(1, 4, 6, 10, generator=torch.Generator().manual_seed(3))  # (B, C, h, w)
    out = pipe(
        prompt_embeds=embeds,
        prompt_embeds_mask=mask,
        latents=pipe._pack_latents(x, 1, 4, 6, 10),
        height=6 * pipe.vae_scale_factor,
        width=10 * pipe.vae_scale_factor,
        num_inference_steps=1,
        true_cfg_scale=1.0,
        output_type="latent",
    ).images
    with torch.no_grad():
        v = adapter.predict(
            pipe.transformer, x, torch.ones(1), Text(embeds, mask, embeds[:, 0, :0])
        )
    assert torch.allclose(out, pipe._pack_latents(x - v, 1, 4, 6, 10), atol=1e-5)

    pixels = torch.rand(1, 3, 16, 24) * 2 - 1
    with torch.no_grad():
        z = adapter.encode_pixels(pipe.vae, pixels)  # (1, 4, 4, 6)
        raw = pipe.vae.encode(pixels[:, :, None]).latent_dist.mean[:, :, 0]
    cfg = pipe.vae.config
    std = 1.0 / torch.tensor(cfg.latents_std).view(1, 4, 1, 1)  # as __call__ computes it
    assert torch.allclose(z / std + torch.tensor(cfg.latents_mean).view(1, 4, 1, 1), raw, atol=1e-5)
    assert not torch.allclose(z, raw, atol=1e-2)  # the normalisation did something

    import shutil

    broken = shutil.copytree(qwenimage_pipeline_dir, tmp_path / "broken")
    config = json.loads((broken / "transformer" / "config.json").read_text())
    (broken / "transformer" / "config.json").write_text(json.dumps({**config, "out_channels": 5}))
    with pytest.raises(PipelineFolderError, match=r"out_channels is 5; expected vae z_dim \(4\)"):
        adapter_for(inspect_pipeline(broken), tmp_path, torch.float32)


def test_qwenimage_resumes_from_its_checkpoint_with_the_same_adapter_and_losses(qwen_run, pipe_io):
    """Qwen-Image killed after step 3 resumes from its own config.json and step-2 checkpoint."""
    pipe_io.assert_resumes(qwen_run[0])

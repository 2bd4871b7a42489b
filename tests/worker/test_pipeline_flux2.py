"""FLUX.2 [klein] from a pipeline folder, end to end through ``workbench train`` with weight
streaming, activation spill and the Conductor on (tiny Flux2KleinPipeline: Qwen3 of 28 tiny
layers, 3 double + 5 single blocks, batch-norm-normalised patchified latents, 64x128 images)."""

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
def flux2_run(flux2_pipeline_dir, wide_images, tmp_path_factory, pipe_io):
    tmp = tmp_path_factory.mktemp("flux2-run")
    # The chat template alone is 25 tokens of the tiny tokenizer: room for the caption after it.
    preset = pipe_io.preset(
        tmp, flux2_pipeline_dir, wide_images, adapter={"rank": 4, "alpha": 8},
        data={"max_caption_tokens": 40},
    )  # fmt: skip
    return pipe_io.train_twice(preset, tmp)


def test_flux2_trains_with_every_runtime_on_and_reuses_the_cache(flux2_run, pipe_io):
    records, of = pipe_io.records, pipe_io.of
    first, second = flux2_run
    recs = records(first)
    assert recs[-1]["status"] == "succeeded"
    (found,) = of(recs, "trainer", "pipeline")
    assert found["family"] == "flux2" and found["pipeline_class"] == "Flux2KleinPipeline"
    names = [b["name"] for b in found["blocks"]]
    assert names == [f"transformer_blocks.{i}" for i in range(3)] + [
        f"single_transformer_blocks.{i}" for i in range(5)
    ]
    steps = of(recs, "trainer", "step")
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert all(math.isfinite(s["loss"]) for s in steps)
    assert [s["step"] for s in steps if "val_loss" in s] == [2, 4]
    stage1 = stage1_steps(recs)
    assert [r["blocks_loaded"] for r in stage1] == [28]  # Qwen3, streamed layer by layer
    assert_streamed_and_spilled(recs)
    paths = [s["path"] for s in of(recs, "trainer", "sample")]
    assert paths == [  # step 0, every 2 steps, the end
        "samples/step-000000-00.png",
        "samples/step-000002-00.png",
        "samples/sample-00.png",
    ]
    from PIL import Image

    with Image.open(first / "samples" / "sample-00.png") as img:
        assert img.size == (128, 64)
    assert_cache_reused(second, steps)


def test_flux2_lora_and_its_comfyui_copy_load_and_agree(flux2_run, flux2_pipeline_dir):
    from diffusers import Flux2KleinPipeline
    from safetensors import safe_open
    from safetensors.torch import load_file

    run_dir, _ = flux2_run
    lora = run_dir / "lora"
    with safe_open(str(lora / "pytorch_lora_weights.safetensors"), "pt") as f:
        targets = json.loads(f.metadata()["stagehand.targets"])
    # train_dreambooth_lora_flux2_klein.py's targets, its single blocks counted from the config.
    assert "to_qkv_mlp_proj" in targets and "single_transformer_blocks.4.attn.to_out" in targets
    comfy = load_file(str(lora / COMFY_FILE))
    # q, k, v fused into BFL's qkv: A stacked (3r, in), B block-diagonal (3 out, 3r).
    assert comfy["diffusion_model.double_blocks.2.img_attn.qkv.lora_A.weight"].shape == (12, 16)
    assert comfy["diffusion_model.double_blocks.2.img_attn.qkv.lora_B.weight"].shape == (48, 12)
    assert "diffusion_model.single_blocks.4.linear2.lora_B.weight" in comfy
    assert not any(k.endswith(".alpha") for k in comfy)  # folded into B

    pipe = Flux2KleinPipeline.from_pretrained(flux2_pipeline_dir, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)

    def generate():
        return pipe(
            prompt="a photo of the digit seven",
            height=64,
            width=128,
            num_inference_steps=2,
            max_sequence_length=40,
            generator=torch.Generator().manual_seed(0),
            output_type="pt",
        ).images

    base = generate()
    pipe.load_lora_weights(lora, adapter_name="diffusers")
    tuned = generate()
    assert tuned.shape == (1, 3, 64, 128) and (tuned - base).abs().max() > 1e-4
    pipe.delete_adapters("diffusers")
    pipe.load_lora_weights(lora, weight_name=COMFY_FILE, adapter_name="comfyui")
    # Not an exactness test: the ComfyUI copy fuses q, k, v into one qkv LoRA (A stacked, B
    # block-diagonal), another GEMM shape, so its float32 rounding depends on the CPU's kernel
    # path (AVX512 on an AMD EPYC: 2.0e-6 at most on images in [0, 1], ATen's baseline kernels:
    # under 1e-6). A wrong conversion (q and k swapped, alpha not folded, a block missed) moves
    # the images by about the LoRA's own effect (9.1e-4 here), so the copy must reproduce
    # that effect to 1%.
    effect = (tuned - base).abs().max()
    assert (generate() - tuned).abs().max() <= 0.01 * effect


def test_flux2_text_latents_and_predict_are_the_pipelines(flux2_run, flux2_pipeline_dir, tmp_path):
    """The cached text is ``encode_prompt``'s; one Euler step of ``__call__`` from sigma 1 is
    x - predict(x, 1); ``mu`` is ``compute_empirical_mu`` at ``__call__``'s 50 steps."""
    from diffusers import Flux2KleinPipeline
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu
    from safetensors.torch import load_file

    from workbench.worker.families import Text
    from workbench.worker.pipelines import adapter_for, inspect_pipeline

    adapter = adapter_for(inspect_pipeline(flux2_pipeline_dir), tmp_path, torch.float32)
    pipe = Flux2KleinPipeline.from_pretrained(flux2_pipeline_dir, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    hidden, _ = pipe.encode_prompt("a photo of the digit seven", max_sequence_length=40)
    (cached,) = (flux2_run[0].parent / "cache" / "trainer-cache").glob("text-*")
    text = load_file(str(cached))
    assert text["hidden"].shape == (7, 40, 36)
    assert torch.allclose(text["hidden"][-1], hidden[0], atol=1e-6)

    x = torch.randn(1, 16, 4, 6, generator=torch.Generator().manual_seed(3))  # patchified
    out = pipe(
        prompt_embeds=hidden,
        latents=x,
        height=4 * 2 * pipe.vae_scale_factor,
        width=6 * 2 * pipe.vae_scale_factor,
        num_inference_steps=1,
        output_type="latent",
    ).images  # (1, C, 8, 12): batch-norm inverted and unpatchified, ready for the VAE
    with torch.no_grad():
        v = adapter.predict(
            pipe.transformer, x, torch.ones(1), Text(hidden, None, hidden[:, 0, :0])
        )
    bn = pipe.vae.bn
    std = (bn.running_var + pipe.vae.config.batch_norm_eps).sqrt().view(1, -1, 1, 1)
    want = pipe._unpatchify_latents((x - v) * std + bn.running_mean.view(1, -1, 1, 1))
    assert torch.allclose(out, want, atol=1e-5) and (v.abs() > 0).any()
    assert adapter.mu(24) == compute_empirical_mu(24, 50)


def test_flux2_folders_that_do_not_fit_are_named(flux2_pipeline_dir, tmp_path):
    """A transformer whose text input is not 3 stacked Qwen3 hidden states; a FLUX.2 [dev]
    (``Flux2Pipeline``) folder; a token limit the chat template alone fills."""
    import shutil

    from workbench.worker.pipelines import (
        PipelineFolderError,
        adapter_for,
        inspect_pipeline,
        trainable,
    )

    folder = shutil.copytree(flux2_pipeline_dir, tmp_path / "copy")
    assert trainable(inspect_pipeline(folder))
    config_path = folder / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "joint_attention_dim": 24}))
    with pytest.raises(PipelineFolderError, match=r"joint_attention_dim is 24; expected 3 stacked"):
        adapter_for(inspect_pipeline(folder), tmp_path, torch.float32)
    config_path.write_text(json.dumps(config))

    index_path = folder / "model_index.json"
    index = json.loads(index_path.read_text())
    index_path.write_text(json.dumps({**index, "_class_name": "Flux2Pipeline"}))
    info = inspect_pipeline(folder)
    assert info.family == "flux2" and not trainable(info)  # the New run page says so
    with pytest.raises(PipelineFolderError, match=r"Flux2Pipeline \(FLUX.2 \[dev\], Mistral 3"):
        adapter_for(info, tmp_path, torch.float32)
    index_path.write_text(json.dumps(index))

    adapter = adapter_for(inspect_pipeline(folder), tmp_path, torch.float32)
    with pytest.raises(
        ValueError, match=r"data.max_caption_tokens is 16 but .*chat template alone is 25"
    ):
        adapter.check_caption_tokens(16)
    adapter.check_caption_tokens(26)


def test_flux2_resumes_from_its_checkpoint_with_the_same_adapter_and_losses(flux2_run, pipe_io):
    """FLUX.2 [klein] killed after step 3 resumes from its own config.json and step-2 checkpoint."""
    pipe_io.assert_resumes(flux2_run[0])

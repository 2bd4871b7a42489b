"""SDXL from a pipeline folder, end to end through ``workbench train`` with weight streaming,
activation spill and the Conductor on (tiny StableDiffusionXLPipeline: CLIP-L 3 layers, CLIP-G
5 layers, a 2-level UNet streamed by its down, mid and up blocks, v-prediction, 64x128 images)."""

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
def sdxl_run(sdxl_pipeline_dir, wide_images, tmp_path_factory, pipe_io):
    tmp = tmp_path_factory.mktemp("sdxl-run")
    preset = pipe_io.preset(tmp, sdxl_pipeline_dir, wide_images, adapter={"rank": 4, "alpha": 8})
    return pipe_io.train_twice(preset, tmp)


def test_sdxl_trains_with_every_runtime_on_and_reuses_the_cache(sdxl_run, pipe_io):
    records, of = pipe_io.records, pipe_io.of
    first, second = sdxl_run
    recs = records(first)
    assert recs[-1]["status"] == "succeeded"
    (found,) = of(recs, "trainer", "pipeline")
    assert found["family"] == "sdxl"
    # The UNet's stages, read from the model: its down blocks, up blocks and mid block.
    names = [b["name"] for b in found["blocks"]]
    assert names == ["down_blocks.0", "down_blocks.1", "up_blocks.0", "up_blocks.1", "mid_block"]
    assert found["largest_block_bytes"] == found["blocks"][2]["nbytes"]  # up_blocks.0
    steps = of(recs, "trainer", "step")
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert all(math.isfinite(s["loss"]) for s in steps)
    assert [s["step"] for s in steps if "val_loss" in s] == [2, 4]
    stage1 = stage1_steps(recs)
    assert [r["blocks_loaded"] for r in stage1] == [3, 5]
    assert_streamed_and_spilled(recs)
    streamed = {r["block_name"] for r in of(recs, "stagehand", "block") if r["step"]}
    assert set(names) <= streamed
    paths = [s["path"] for s in of(recs, "trainer", "sample")]
    assert paths == [  # step 0, every 2 steps, the end
        "samples/step-000000-00.png",
        "samples/step-000002-00.png",
        "samples/sample-00.png",
    ]
    assert_cache_reused(second, steps)


def test_sdxl_lora_and_its_comfyui_copy_load_and_agree(sdxl_run, sdxl_pipeline_dir):
    from diffusers import StableDiffusionXLPipeline
    from safetensors import safe_open
    from safetensors.torch import load_file

    run_dir, _ = sdxl_run
    lora = run_dir / "lora"
    with safe_open(str(lora / "pytorch_lora_weights.safetensors"), "pt") as f:
        meta = f.metadata()
        keys = list(f.keys())
    assert meta["stagehand.family"] == "sdxl" and all(k.startswith("unet.") for k in keys)
    assert json.loads(meta["stagehand.targets"]) == ["to_k", "to_out.0", "to_q", "to_v"]

    pipe = StableDiffusionXLPipeline.from_pretrained(sdxl_pipeline_dir, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)

    def generate():
        return pipe(
            "a photo of the digit seven",
            height=64,
            width=128,
            num_inference_steps=2,
            guidance_scale=1.0,  # no CFG: one UNet pass a step is enough to compare
            generator=torch.Generator().manual_seed(0),
            output_type="pt",
        ).images

    base = generate()
    pipe.load_lora_weights(lora, adapter_name="diffusers")
    tuned = generate()
    assert tuned.shape == (1, 3, 64, 128) and (tuned - base).abs().max() > 1e-4
    # kohya's names over the original UNet (down_blocks.1.attentions.0 is input_blocks.3.1 with
    # one resnet per level); alpha 8 / rank 4 is folded into lora_up, so .alpha is the rank.
    comfy = load_file(str(lora / COMFY_FILE))
    key = "lora_unet_input_blocks_3_1_transformer_blocks_0_attn1_to_q"
    assert comfy[f"{key}.alpha"].item() == 4.0 and comfy[f"{key}.lora_down.weight"].shape[0] == 4
    assert "lora_unet_middle_block_1_transformer_blocks_2_attn2_to_out_0.lora_up.weight" in comfy
    pipe.delete_adapters("diffusers")
    pipe.load_lora_weights(lora, weight_name=COMFY_FILE, adapter_name="comfyui")
    assert torch.allclose(generate(), tuned, atol=1e-6)


def test_sdxl_text_time_ids_and_targets_are_the_pipelines(sdxl_run, sdxl_pipeline_dir, tmp_path):
    """The cached text is ``encode_prompt``'s; ``predict`` gives the UNet the ``time_ids``
    ``__call__`` gives it; the target is v-prediction on the folder's betas."""
    from diffusers import StableDiffusionXLPipeline
    from safetensors.torch import load_file

    from workbench.worker.pipelines import adapter_for, inspect_pipeline

    adapter = adapter_for(inspect_pipeline(sdxl_pipeline_dir), tmp_path, torch.float32)
    pipe = StableDiffusionXLPipeline.from_pretrained(sdxl_pipeline_dir, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    hidden, _, pooled, _ = pipe.encode_prompt(
        "a photo of the digit seven", do_classifier_free_guidance=False
    )
    (cached,) = (sdxl_run[0].parent / "cache" / "trainer-cache").glob("text-*")
    text = load_file(str(cached))
    assert text["hidden"].shape == (7, 77, 48) and text["pooled"].shape == (7, 14)
    # Batched with the other texts and streamed, as the pipeline is not: equal to float32 noise.
    assert torch.allclose(text["hidden"][-1], hidden[0], atol=1e-6)
    assert torch.allclose(text["pooled"][-1], pooled[0], atol=1e-6)

    seen = {}
    pipe.unet.register_forward_pre_hook(
        lambda m, args, kwargs: seen.update(kwargs["added_cond_kwargs"]), with_kwargs=True
    )
    pipe(prompt_embeds=hidden, pooled_prompt_embeds=pooled, height=24, width=40,
         num_inference_steps=1, guidance_scale=1.0, output_type="latent")  # fmt: skip
    x = torch.zeros(2, 4, 6, 10)  # (B, C, h, w): 24 x 40 pixels
    want = adapter.add_time_ids(pipe.unet, 2, 6, 10, 14, x)
    assert torch.equal(want, seen["time_ids"].repeat(2, 1))
    assert want[0].tolist() == [24, 40, 0, 0, 24, 40]

    g = torch.Generator().manual_seed(5)
    x0, noise = torch.randn(2, 4, 6, 10, generator=g), torch.randn(2, 4, 6, 10, generator=g)
    x_t, t, target = adapter.training_pair(x0, noise, torch.Generator().manual_seed(1), None)
    betas = torch.linspace(0.00085**0.5, 0.012**0.5, 1000) ** 2  # scaled_linear
    a = torch.cumprod(1 - betas, 0)[t].view(-1, 1, 1, 1)  # (B, 1, 1, 1) alpha-bar
    assert torch.allclose(x_t, a.sqrt() * x0 + (1 - a).sqrt() * noise, atol=1e-6)
    assert torch.allclose(target, a.sqrt() * noise - (1 - a).sqrt() * x0, atol=1e-6)
    assert adapter.validation_pair(x0, noise, 0.75)[1].tolist() == [749, 749]
    adapter.check_validation()  # DDPM with a validation loss, unlike the factory UNet family
    from workbench.worker.families import family

    with pytest.raises(ValueError, match="validation_every: the unet family has no flow valid"):
        family("unet").check_validation()


def test_the_real_sdxl_unet_streams_its_seven_stages():
    """SDXL base 1.0's UNet config, built on meta (2,567,463,684 parameters, its published
    count): the weight runtime streams its 3 down, 3 up and mid blocks, found from the model."""
    from diffusers import UNet2DConditionModel

    from stagehand.weights.registry import find_blocks

    with torch.device("meta"):
        unet = UNet2DConditionModel(
            sample_size=128,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            block_out_channels=(320, 640, 1280),
            transformer_layers_per_block=(1, 2, 10),
            attention_head_dim=(5, 10, 20),
            cross_attention_dim=2048,
            use_linear_projection=True,
            addition_embed_type="text_time",
            addition_time_embed_dim=256,
            projection_class_embeddings_input_dim=2816,
        )
    assert sum(p.numel() for p in unet.parameters()) == 2_567_463_684
    mb = {n: sum(p.numel() for p in m.parameters()) * 2 / 2**20 for n, m in find_blocks(unet)}
    assert list(mb) == [*(f"down_blocks.{i}" for i in range(3)), *(f"up_blocks.{i}" for i in range(3)), "mid_block"]  # fmt: skip
    assert round(mb["up_blocks.0"], 1) == 2301.3 and round(mb["mid_block"], 1) == 788.0  # bf16
    # What stays resident (embeddings, conv in/out) is 14 MB of 4897 MB.
    streamed = sum(mb.values())
    assert streamed / (2_567_463_684 * 2 / 2**20) > 0.99


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        (
            "cross_attention_dim",
            32,
            r"cross_attention_dim is 32; expected text_encoder \+ text_enc",
        ),
        (
            "projection_class_embeddings_input_dim",
            40,
            r"projection_class_embeddings_input_dim is 40",
        ),
        ("addition_embed_type", None, r"addition_embed_type is None; expected 'text_time'"),
    ],
)
def test_sdxl_unet_that_does_not_fit_is_named(sdxl_pipeline_dir, tmp_path, field, value, message):
    import shutil

    from workbench.worker.pipelines import PipelineFolderError, adapter_for, inspect_pipeline

    folder = shutil.copytree(sdxl_pipeline_dir, tmp_path / "copy")
    config = json.loads((folder / "unet" / "config.json").read_text())
    (folder / "unet" / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(PipelineFolderError, match=message) as err:
        adapter_for(inspect_pipeline(folder), tmp_path, torch.float32)
    assert f"{folder}/unet/config.json: does not fit the sdxl pipeline" in str(err.value)


def test_sdxl_resumes_from_its_checkpoint_with_the_same_adapter_and_losses(sdxl_run, pipe_io):
    """SDXL killed after step 3 resumes from its own config.json and step-2 checkpoint."""
    pipe_io.assert_resumes(sdxl_run[0])

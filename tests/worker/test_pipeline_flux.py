"""FLUX.1 from a pipeline folder, end to end through ``workbench train`` with weight streaming,
activation spill and the Conductor on (tiny FluxPipeline: CLIP + T5, 3 double + 5 single
blocks, 64x128 images)."""

import json
import math

import pytest
import torch

from tests.worker.conftest import stage1_steps
from workbench.worker.assets import ENV_VAR
from workbench.worker.cli import main


@pytest.fixture(scope="module")
def flux_run(flux_pipeline_dir, wide_images, tmp_path_factory, pipe_io):
    """One run (and a second one on the same cache) of the tiny Flux pipeline."""
    tmp = tmp_path_factory.mktemp("flux-run")
    preset = pipe_io.preset(tmp, flux_pipeline_dir, wide_images)
    return pipe_io.train_twice(preset, tmp)


def test_flux_pipeline_trains_with_every_runtime_on(flux_run, pipe_io):
    records, of = pipe_io.records, pipe_io.of
    run_dir, _ = flux_run
    recs = records(run_dir)
    assert recs[-1]["kind"] == "run_finished" and recs[-1]["status"] == "succeeded"
    # The inspection, before stage 1: the 8 blocks the weight runtime streams.
    (found,) = of(recs, "trainer", "pipeline")
    assert found["family"] == "flux" and len(found["blocks"]) == 8
    assert found["largest_block_bytes"] == max(b["nbytes"] for b in found["blocks"]) > 0
    steps = of(recs, "trainer", "step")
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert all(math.isfinite(s["loss"]) and s["loss"] > 0 for s in steps)
    # Validation every 2 steps on the held-out sample, fixed noise and sigmas.
    assert [s["step"] for s in steps if "val_loss" in s] == [2, 4]
    assert all(math.isfinite(s["val_loss"]) for s in steps if "val_loss" in s)
    # Stage 1: CLIP then T5, each streamed from its files as an inference step 0, released.
    stage1 = stage1_steps(recs)
    assert len(stage1) == 2 and all(r["file_reads"] > 0 for r in stage1)
    messages = [r["message"] for r in of(recs, "trainer", "stage")]
    assert "text_encoder released (1/2)" in messages
    assert "text_encoder_2 released (2/2)" in messages
    # Stage 2: every training step streamed blocks and spilled activations.
    train = [r for r in of(recs, "stagehand", "step") if r["step"] in (1, 2, 3, 4)]
    assert sum(r["blocks_evicted"] for r in train) > 0
    spilled = [r["activations_spilled"] for r in of(recs, "activation_stagehand", "step")]
    assert sum(spilled) > 0
    assert {r["step"] for r in of(recs, "conductor", "step")} >= {1, 2, 3, 4}
    # Samples at step 0 and every 2 steps (through the training strategy), and at the end,
    # stamped with the last step trained (no record lies past it).
    sample = of(recs, "trainer", "sample")
    assert [(s["step"], s["path"]) for s in sample] == [
        (0, "samples/step-000000-00.png"),
        (2, "samples/step-000002-00.png"),
        (4, "samples/sample-00.png"),
    ]
    assert max(r["step"] for r in recs if r.get("step") is not None) == 4
    from PIL import Image

    with Image.open(run_dir / "samples" / "sample-00.png") as img:
        assert img.size == (128, 64)  # width, height of the 64x128 bucket
    # 16 wide, not FLUX.1's 3072: diffusers' converter could not read a ComfyUI copy back.
    assert not (run_dir / "lora" / "comfyui-lora.safetensors").exists()


def test_second_flux_run_reuses_the_cache_and_repeats_the_losses(flux_run, pipe_io):
    records, of = pipe_io.records, pipe_io.of
    first, second = flux_run
    messages = [r["message"] for r in of(records(second), "trainer", "stage")]
    assert any(m.startswith("text embeddings reused") for m in messages)
    assert any(m.startswith("latents reused") for m in messages)
    assert not any(m.startswith("text_encoder released") for m in messages)
    losses = [[s["loss"] for s in of(records(r), "trainer", "step")] for r in flux_run]
    assert losses[0] == losses[1]


def test_flux_lora_loads_into_the_pipeline_with_metadata(flux_run, flux_pipeline_dir):
    from diffusers import FluxPipeline
    from safetensors import safe_open

    run_dir, _ = flux_run
    lora = run_dir / "lora"
    with safe_open(str(lora / "pytorch_lora_weights.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["stagehand.family"] == "flux"
    assert meta["stagehand.base_model"] == str(flux_pipeline_dir)
    assert meta["stagehand.steps"] == "4" and meta["stagehand.rank"] == "4"
    # diffusers' train_dreambooth_lora_flux.py targets (the preset names none).
    targets = json.loads(meta["stagehand.targets"])
    assert len(targets) == 12 and "ff_context.net.2" in targets and "attn.to_add_out" in targets
    assert json.loads(meta["lora_adapter_metadata"])["transformer.r"] == 4

    pipe = FluxPipeline.from_pretrained(flux_pipeline_dir, dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)

    def generate():
        return pipe(
            "a photo of the digit seven",
            height=64,
            width=128,
            num_inference_steps=2,
            max_sequence_length=16,
            generator=torch.Generator().manual_seed(0),
            output_type="pt",
        ).images

    base = generate()
    pipe.load_lora_weights(lora)
    assert pipe.transformer.peft_config  # the adapter is in
    tuned = generate()
    assert tuned.shape == (1, 3, 64, 128)
    assert (tuned - base).abs().max() > 1e-4


def test_every_text_encoder_is_released_before_the_transformer_loads(
    flux_pipeline_dir, wide_images, tmp_path, monkeypatch, pipe_io
):
    """The seed's bug 3: stage 2 must not start with an encoder (or its strategy) alive."""
    import gc
    import warnings

    from transformers import PreTrainedModel

    from stagehand.strategy.base import MemoryStrategy
    from workbench.worker import loop

    def live() -> list:
        gc.collect()
        kinds = (PreTrainedModel, MemoryStrategy)
        with warnings.catch_warnings():  # isinstance on every object touches deprecated modules
            warnings.simplefilter("ignore", FutureWarning)
            return [o for o in gc.get_objects() if isinstance(o, kinds)]

    before = {id(o) for o in live()}  # other tests' objects the session still holds
    alive = {}
    real = loop.load_transformer

    def load_transformer_after_checking(*args, **kwargs):
        new = [o for o in live() if id(o) not in before]
        alive["encoders"] = [type(o).__name__ for o in new if isinstance(o, PreTrainedModel)]
        alive["strategies"] = [type(o).__name__ for o in new if isinstance(o, MemoryStrategy)]
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "load_transformer", load_transformer_after_checking)
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "cache"))
    preset = pipe_io.preset(
        tmp_path, flux_pipeline_dir, wide_images, max_steps=1, samples={"prompts": []}
    )
    assert main([str(preset), "--run-dir", str(tmp_path / "run")]) == 0
    assert alive == {"encoders": [], "strategies": []}


def test_flux1_comfyui_copy_round_trips_and_patches_bfl_weights_at_strength():
    """FLUX.1's real width (3072, the converter has it built in) with 1 double + 2 single
    blocks, on meta; rank-4 LoRAs on the Flux targets, their B holding the folded scale as
    ``save_lora`` passes them. The kohya-layout copy read back by ``FluxPipeline.lora_state_dict``
    gives every A and B again, bit for bit, plus zero LoRAs on the single blocks' ``proj_mlp``
    (the zero block of the fused ``linear1``). Under ComfyUI's rule (``test_lora_export``'s
    module doc: ``.alpha / rank`` times up @ down) every module patches its BFL weight, whose
    rows are the diffusers modules' outputs stacked (BFL's ``qkv = Linear(h, 3h)``, ``linear1 =
    Linear(h, 3h + mlp)``), with exactly the update B @ A of each diffusers module."""
    from diffusers import FluxPipeline, FluxTransformer2DModel

    from tests.worker.test_lora_export import comfy_deltas
    from workbench.worker.pipelines.flux import FluxPipelineFamily
    from workbench.worker.pipelines.flux_comfy import kohya_flux_state_dict

    with torch.device("meta"):
        model = FluxTransformer2DModel(
            in_channels=64, num_layers=1, num_single_layers=2, attention_head_dim=128,
            num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
            guidance_embeds=True, axes_dims_rope=(16, 56, 56),
        )  # fmt: skip
    targets = FluxPipelineFamily.lora_targets
    g = torch.Generator().manual_seed(0)
    state, linears = {}, {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and any(name.endswith("." + t) for t in targets):
            linears[name] = module
            state[f"transformer.{name}.lora_A.weight"] = torch.randn(
                4, module.in_features, generator=g
            )
            state[f"transformer.{name}.lora_B.weight"] = torch.randn(
                module.out_features, 4, generator=g
            )
    assert len(state) == 2 * (12 + 2 * 3)  # 12 targets in the double block, q/k/v in singles

    comfy = kohya_flux_state_dict(state, width=3072)
    qkv = "lora_unet_double_blocks_0_img_attn_qkv"
    assert comfy[f"{qkv}.lora_down.weight"].shape == (12, 3072)  # q, k, v stacked
    assert comfy["lora_unet_single_blocks_1_linear1.lora_up.weight"].shape == (3 * 3072 + 12288, 16)
    back = FluxPipeline.lora_state_dict(comfy)
    for key, value in state.items():
        assert torch.equal(back[key], value), key
    extra = sorted(set(back) - set(state))
    assert extra == [
        f"transformer.single_transformer_blocks.{i}.proj_mlp.lora_{ab}.weight"
        for i in range(2)
        for ab in "AB"
    ]
    assert all(not back[k].any() for k in extra)

    def delta(module: str) -> torch.Tensor:  # the diffusers module's update, (out, in)
        lora = f"transformer.{module}.lora_"
        return state[lora + "B.weight"] @ state[lora + "A.weight"]

    fused = {
        "double_blocks_0_img_attn_qkv": [f"transformer_blocks.0.attn.to_{p}" for p in "qkv"],
        "double_blocks_0_txt_attn_qkv": [f"transformer_blocks.0.attn.add_{p}_proj" for p in "qkv"],
        **{
            f"single_blocks_{i}_linear1": [
                *(f"single_transformer_blocks.{i}.attn.to_{p}" for p in "qkv"),
                f"single_transformer_blocks.{i}.proj_mlp",
            ]
            for i in range(2)
        },
    }
    stems = [k.removesuffix(".alpha") for k in comfy if k.endswith(".alpha")]
    assert len(stems) == 6 + 2 + 2  # double block: 6 linears and 2 fused qkv; 1 linear1 a single
    for x in stems:  # the rank: scale 1, the scale is in lora_up
        assert comfy[f"{x}.alpha"].item() == comfy[f"{x}.lora_down.weight"].shape[0], x
    for stem, parts in fused.items():
        patch = comfy_deltas({k: v for k, v in comfy.items() if k.startswith(f"lora_unet_{stem}.")})
        (rows,) = patch.values()
        mlp = 4 * 3072  # BFL's single block: linear1 = Linear(h, 3h + mlp_hidden)
        assert rows.shape == (3 * 3072 + (mlp if "linear1" in stem else 0), 3072), stem
        at = 0
        for part in parts:
            if part.endswith("proj_mlp"):
                assert not rows[at:].any()  # no LoRA there: a zero block
                break
            module = linears[part]
            assert torch.equal(rows[at : at + module.out_features], delta(part)), part
            at += module.out_features
    assert kohya_flux_state_dict(state, width=16) is None  # not readable back: no copy


def test_flux_resumes_from_its_checkpoint_with_the_same_adapter_and_losses(flux_run, pipe_io):
    """Flux killed after step 3 resumes from its own config.json and step-2 checkpoint."""
    pipe_io.assert_resumes(flux_run[0])

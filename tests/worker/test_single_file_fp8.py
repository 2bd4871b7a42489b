"""``model.transformer_path`` of 8-bit weights: a single file in the original
release layout whose linear weights are float8_e4m3fn, with a per-tensor ``scale_weight``
(ComfyUI's fp8 files) or a per-row ``weight_scale``, is converted into diffusers' layout with
its codes untouched and streams with SquareQ as stored, training bit for bit as the model
holding ``codes * scale``; a file it cannot read names the key, the dtype and the scale.

The file is the tiny SD3 pipeline's transformer written in the original SD3 layout (fused
``qkv`` rows, the last context block's and the final layer's modulation halves swapped), by
``original_rows`` below, checked against diffusers' own converter by the round trip. FLUX.1's
converter (``convert_flux_transformer_checkpoint_to_diffusers``) splits the single blocks'
``linear1`` at FLUX.1's fixed width (3072), so no tiny FLUX.1 file converts; SD3's converter
takes its sizes from the file.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from stagehand.squareq.formats import dequantize, quantize
from stagehand.squareq.prequantized import row_scales
from stagehand.strategy import build_strategy
from workbench.worker.pipelines import PipelineFolderError, inspect_pipeline
from workbench.worker.pipelines.folder import tensors_of, weight_files
from workbench.worker.pipelines.single_file import convert_single_file

from ..runtime.exact import assert_exact, make_model, train

PARITY = pytest.mark.parity
"""The tests that compare numbers (rerun by ``./dev test`` on ATen's baseline kernels); the
refusals compare none."""

FUSED = {  # original fused q/k/v -> diffusers' three projections, rows in that order
    "x_block.attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "context_block.attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "x_block.attn2.qkv": ("attn2.to_q", "attn2.to_k", "attn2.to_v"),
}
BLOCK = {  # diffusers -> original, inside transformer_blocks.N / joint_blocks.N
    "attn.norm_q": "x_block.attn.ln_q",
    "attn.norm_k": "x_block.attn.ln_k",
    "attn.norm_added_q": "context_block.attn.ln_q",
    "attn.norm_added_k": "context_block.attn.ln_k",
    "attn.to_out.0": "x_block.attn.proj",
    "attn.to_add_out": "context_block.attn.proj",
    "attn2.norm_q": "x_block.attn2.ln_q",
    "attn2.norm_k": "x_block.attn2.ln_k",
    "attn2.to_out.0": "x_block.attn2.proj",
    "norm1.linear": "x_block.adaLN_modulation.1",
    "norm1_context.linear": "context_block.adaLN_modulation.1",
    "ff.net.0.proj": "x_block.mlp.fc1",
    "ff.net.2": "x_block.mlp.fc2",
    "ff_context.net.0.proj": "context_block.mlp.fc1",
    "ff_context.net.2": "context_block.mlp.fc2",
}
OUTER = {
    "pos_embed.pos_embed": "pos_embed",
    "pos_embed.proj": "x_embedder.proj",
    "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
    "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
    "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
    "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2",
    "context_embedder": "context_embedder",
    "proj_out": "final_layer.linear",
    "norm_out.linear": "final_layer.adaLN_modulation.1",
}


def original_rows(state: dict[str, torch.Tensor]) -> dict[str, list[tuple[str, int, int]]]:
    """The original SD3 layout of diffusers' ``state``: ``{original key: [(diffusers key, first
    row, end row), ...]}``, the original tensor being those rows stacked in order."""
    layers = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("transformer_blocks."))
    out: dict[str, list[tuple[str, int, int]]] = {}
    for key, value in state.items():
        module, _, leaf = key.rpartition(".")
        if key == "pos_embed.pos_embed":
            module, leaf = key, ""
        rows = value.shape[0] if value.dim() else 0
        swap = module == "norm_out.linear" or module == f"transformer_blocks.{layers - 1}.norm1_context.linear"  # fmt: skip
        if module.startswith("transformer_blocks."):
            _, i, inner = module.split(".", 2)
            fused = [(f, part.index(inner)) for f, part in FUSED.items() if inner in part]
            if fused:
                name, at = fused[0]
                pieces = out.setdefault(f"joint_blocks.{i}.{name}.{leaf}", [None] * 3)
                pieces[at] = (key, 0, rows)
                continue
            name = f"joint_blocks.{i}.{BLOCK[inner]}"
        else:
            name = OUTER[module]
        name = f"{name}.{leaf}" if leaf else name
        # diffusers' AdaLayerNormContinuous is (scale, shift); the original (shift, scale)
        half = rows // 2
        out[name] = [(key, half, rows), (key, 0, half)] if swap else [(key, 0, rows)]
    return out


def stack(state, pieces):
    return torch.cat([state[k][a:b] for k, a, b in pieces])


def write_fp8_file(state, path, variant, broken=None):
    """``state`` (diffusers) in the original layout, its block linear weights and the final
    layer's as float8_e4m3fn: ``per-tensor`` ComfyUI's way (``scale_weight``, 0-d or one
    element, the ``scaled_fp8`` flag, a ``model.diffusion_model.`` prefix), ``per-row``
    (``weight_scale`` (rows, 1), one weight unscaled). Returns ``{original key: (codes, scale
    per row fp32, scaled)}`` of the 8-bit ones and the layout."""
    layout = original_rows(state)
    prefix = "model.diffusion_model." if variant == "per-tensor" else ""
    out, stored = {}, {}
    if variant == "per-tensor":
        out["scaled_fp8"] = torch.empty(0, dtype=torch.float8_e4m3fn)
    for i, (name, pieces) in enumerate(sorted(layout.items())):
        value = stack(state, pieces).contiguous()
        key = prefix + name
        fp8 = name.endswith(".weight") and value.dim() == 2
        fp8 = fp8 and (name.startswith("joint_blocks.") or name == "final_layer.linear.weight")
        if not fp8:
            out[key] = value
            continue
        owner = key.removesuffix(".weight")
        if variant == "per-tensor":
            scale = value.abs().max() / 448
            codes = (value / scale).to(torch.float8_e4m3fn)
            out[f"{owner}.scale_weight"] = scale.reshape(() if i % 2 else (1,)).float()
            scaled = True
        elif name == "joint_blocks.1.x_block.mlp.fc2.weight":  # unscaled: within e4m3's range
            codes, scaled = value.to(torch.float8_e4m3fn), False
        else:
            codes, rows = quantize(value, "fp8_e4m3")
            out[f"{owner}.weight_scale"] = rows.reshape(-1, 1)
            scaled = True
        out[key] = codes
        stored[name] = (codes, row_scales(out.get(f"{owner}.scale_weight", out.get(f"{owner}.weight_scale")), codes.shape[0]), scaled)  # fmt: skip
    if broken == "e5m2":
        key = prefix + "joint_blocks.0.x_block.attn.qkv.weight"
        out[key] = out[key].float().to(torch.float8_e5m2)
    elif broken == "blockwise":
        owner = prefix + "joint_blocks.0.x_block.attn.qkv"
        out.pop(f"{owner}.scale_weight", None)
        out[f"{owner}.weight_scale"] = torch.ones(2, 2)
    save_file(out, str(path))
    return stored, layout


@pytest.fixture
def sd3_state(sd3_pipeline_dir):
    from diffusers import SD3Transformer2DModel

    model = SD3Transformer2DModel.from_pretrained(sd3_pipeline_dir / "transformer")
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@PARITY
def test_original_layout_round_trips_through_diffusers_converter(sd3_state):
    """``original_rows`` is the inverse of diffusers' SD3 converter (what ``from_single_file``
    runs), so the files below are in the layout that converter reads."""
    from diffusers.loaders.single_file_utils import convert_sd3_transformer_checkpoint_to_diffusers

    layout = original_rows(sd3_state)
    assert "joint_blocks.0.x_block.attn2.qkv.weight" in layout
    original = {name: stack(sd3_state, pieces) for name, pieces in layout.items()}
    back = convert_sd3_transformer_checkpoint_to_diffusers(original)
    assert sorted(back) == sorted(sd3_state)
    for key, value in sd3_state.items():
        assert torch.equal(back[key], value), key


def section(cache, fmt="int8"):
    sh = {
        "pinned_pool_mb": 4,
        "pinned_slab_mb": 1,
        "prefetch_window_blocks": 1,
        "vram_high_watermark_mb": 0,
        "vram_low_watermark_mb": 0,
        "squareq": {"format": fmt, "cache_dir": str(cache)},
    }
    return {"strategy": "stagehand", "gradient_checkpointing": True, "stagehand": sh}


@PARITY
@pytest.mark.parametrize("variant", ["per-tensor", "per-row"])
def test_fp8_single_file_converts_as_stored_and_trains_as_its_weights(
    sd3_pipeline_dir, sd3_state, tmp_path, variant
):
    single = tmp_path / "sd3-fp8.safetensors"
    stored, layout = write_fp8_file(sd3_state, single, variant)
    info = inspect_pipeline(sd3_pipeline_dir, transformer_path=str(single))
    folder = convert_single_file(info, tmp_path / "cache", torch.float32, prequantized=True)
    converted = {}
    for f in weight_files(folder):
        converted.update(load_file(f))
    # (1) Each converted block weight holds the file's codes of its rows, byte for byte, and
    # their scales (per row, fp32); outside the blocks (proj_out) codes * scale in fp32.
    reference, checked = {}, set()
    for name, (codes, scales, scaled) in stored.items():
        deq = dequantize(codes, scales, torch.float32)
        at = 0
        for key, a, b in layout[name]:
            rows = slice(at, at + b - a)
            at += b - a
            reference.setdefault(key, torch.empty_like(sd3_state[key]))[a:b] = deq[rows]
            if not key.startswith("transformer_blocks."):
                assert converted[key].dtype == torch.float32
                continue
            got = converted[key]
            assert got.dtype == torch.float8_e4m3fn
            assert torch.equal(got.view(torch.uint8)[a:b], codes.view(torch.uint8)[rows]), key
            scale_key = key.removesuffix(".weight") + ".weight_scale"
            assert (scale_key in converted) == scaled, key
            if scaled:
                assert converted[scale_key].dtype == torch.float32
                assert torch.equal(converted[scale_key][a:b], scales[rows]), key
            checked.add(key)
    assert checked == {k for k in reference if k.startswith("transformer_blocks.")}
    assert {"transformer_blocks.0.attn2.to_v.weight", "transformer_blocks.2.norm1_context.linear.weight"} <= checked  # fmt: skip
    assert tensors_of(weight_files(folder))["proj_out.weight"]["dtype"] == "F32"
    # (2) Streamed with SquareQ from that folder = the resident model holding codes * scale.
    plain = make_model("sd3", sd3_pipeline_dir / "transformer", "lora", "non-reentrant", True)
    params = dict(plain.named_parameters())
    for key, value in reference.items():
        name = key.removesuffix(".weight") + ".base_layer.weight"  # a LoRA target's base
        params.get(name, params.get(key)).data = value
    want = train(plain)
    model = make_model("sd3", folder, "lora", "non-reentrant")
    built = build_strategy(model, section(tmp_path / "sq"), device="cpu", checkpoint_dir=folder)
    squareq = built.weights.squareq.info
    blocks = sum(k.startswith("transformer_blocks.") for k in reference)
    assert squareq["prequantized_layers"] == blocks > 0 and squareq["quantized_layers"] == 0
    assert_exact(want, train(model, built))


@pytest.mark.parametrize("broken", ["e5m2", "blockwise", "no-squareq"])
def test_unreadable_fp8_single_file_names_key_dtype_and_scale(
    sd3_pipeline_dir, sd3_state, tmp_path, broken
):
    single = tmp_path / "sd3-fp8.safetensors"
    write_fp8_file(sd3_state, single, "per-tensor", None if broken == "no-squareq" else broken)
    info = inspect_pipeline(sd3_pipeline_dir, transformer_path=str(single))
    with pytest.raises(PipelineFolderError) as raised:
        convert_single_file(info, tmp_path / "cache", torch.float32, broken != "no-squareq")
    message = str(raised.value)
    key = "model.diffusion_model.joint_blocks.0.x_block.attn.qkv"
    assert message.startswith("model.transformer_path: checkpoint tensor") and "sd3-fp8" in message
    if broken == "e5m2":
        assert f"'{key}.weight' in sd3-fp8.safetensors is torch.float8_e5m2 (48, 16)" in message
    elif broken == "blockwise":
        assert f"'{key}.weight_scale' of shape (2, 2)" in message and "block-wise" in message
    else:
        assert "scale_weight" in message and "memory.stagehand.squareq" in message
    assert not (tmp_path / "cache").exists()


@PARITY
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_unscaled_8bit_single_file_without_squareq_is_upcast_as_any_file(
    sd3_pipeline_dir, sd3_state, tmp_path, dtype
):
    """SquareQ off: unscaled 8-bit weights (e5m2 too) are read as any precision, as before."""
    from diffusers import SD3Transformer2DModel

    layout = original_rows(sd3_state)
    tensors = {name: stack(sd3_state, pieces).contiguous() for name, pieces in layout.items()}
    for name, value in tensors.items():
        if name.startswith("joint_blocks.") and name.endswith(".weight") and value.dim() == 2:
            tensors[name] = value.to(dtype)
    single = tmp_path / "sd3-8bit.safetensors"
    save_file(tensors, str(single))
    info = inspect_pipeline(sd3_pipeline_dir, transformer_path=str(single))
    folder = convert_single_file(info, tmp_path / "cache", torch.float32)
    got = SD3Transformer2DModel.from_pretrained(folder).state_dict()
    for key, pieces in layout.items():
        assert torch.equal(stack(got, pieces), tensors[key].float()), key
    # The copy is keyed by the run's dtype too: a bf16 run does not reuse the fp32 copy.
    again = convert_single_file(info, tmp_path / "cache", torch.bfloat16)
    assert again != folder
    assert {v.dtype for v in load_file(next(again.glob("*.safetensors"))).values()} == {
        torch.bfloat16
    }


@PARITY
def test_preset_with_squareq_trains_from_fp8_single_file(
    sd3_pipeline_dir, sd3_state, wide_images, tmp_path, monkeypatch, pipe_io
):
    """The trainer passes SquareQ's state to the conversion: a preset with
    ``memory.stagehand.squareq`` trains from a ComfyUI-style file, its block weights streamed
    as stored (``squareq/step``: no weight quantized again)."""
    from workbench.worker.assets import ENV_VAR
    from workbench.worker.cli import main

    monkeypatch.setenv(ENV_VAR, str(tmp_path / "cache"))
    single = tmp_path / "sd3-fp8.safetensors"
    stored, layout = write_fp8_file(sd3_state, single, "per-tensor")
    squareq = {"format": "int8", "cache_dir": str(tmp_path / "sq")}
    preset = pipe_io.preset(
        tmp_path, sd3_pipeline_dir, wide_images, name="fp8",
        model={"path": str(sd3_pipeline_dir), "dtype": "float32", "transformer_path": str(single)},
        memory={"stagehand": {"squareq": squareq}},
        max_steps=1, validation_every=None, samples={"prompts": []},
    )  # fmt: skip
    assert main([str(preset), "--run-dir", str(tmp_path / "run")]) == 0
    (record,) = pipe_io.of(pipe_io.records(tmp_path / "run"), "squareq", "step")[:1]
    blocks = {k for n in stored for k, _, _ in layout[n] if k.startswith("transformer_blocks.")}
    assert record["prequantized_layers"] == len(blocks) and record["quantized_layers"] == 0


@pytest.mark.parametrize("memory", ["none", "module-backed", "squareq"])
def test_scaled_fp8_folder_without_file_backed_squareq_is_refused_naming_model_path(
    sd3_pipeline_dir, wide_images, tmp_path, pipe_io, memory
):
    """A diffusers-layout folder (``model.path``) of scaled fp8 weights loaded without SquareQ
    streaming it from the files (strategy none, or module-backed blocks, which hold what
    ``from_pretrained`` read: the codes without their scales) is refused, naming the field, the
    key and the scale; with file-backed SquareQ it binds."""
    import shutil

    from workbench.worker.preset import load_preset, validate_preset
    from workbench.worker.setup import pipeline_family

    folder = tmp_path / "pipe"
    shutil.copytree(sd3_pipeline_dir, folder)
    key = "transformer_blocks.0.attn.to_q.weight"
    path = next(p for p in weight_files(folder / "transformer") if key in load_file(p))
    tensors = load_file(path)
    codes, scales = quantize(tensors[key], "fp8_e4m3")
    tensors[key], tensors[key.replace(".weight", ".weight_scale")] = codes, scales.reshape(-1, 1)
    save_file(tensors, str(path))
    stagehand = {"squareq": {"format": "fp8_e4m3", "cache_dir": str(tmp_path / "sq")}}
    if memory == "module-backed":
        stagehand["file_backed"] = False
    over = (
        {"memory": {"strategy": "none"}}
        if memory == "none"
        else {"memory": {"stagehand": stagehand}}
    )
    preset = validate_preset(load_preset(pipe_io.preset(tmp_path, folder, wide_images, **over))[1])
    if memory == "squareq":
        assert pipeline_family(preset, torch.device("cpu")) is not None
        return
    with pytest.raises(PipelineFolderError) as raised:
        pipeline_family(preset, torch.device("cpu"))
    message = str(raised.value)
    assert message.startswith(f"model.path: checkpoint tensor {key!r} in {path.name}")
    assert "weight_scale" in message and "memory.stagehand.squareq" in message

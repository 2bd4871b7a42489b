"""Pre-quantized checkpoints: a transformer whose block linear weights are stored as
float8_e4m3fn (with a per-tensor ``scale_weight`` as ComfyUI's fp8 FLUX files, a per-row
``weight_scale``, or no scale) streams with SquareQ as stored, and trains bit for bit as the
model holding ``codes * scale`` resident; a file the product cannot read names the key and
dtype."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from stagehand.squareq.formats import dequantize, quantize
from stagehand.squareq.prequantized import PrequantizedCheckpointError
from stagehand.strategy import build_strategy

from .exact import assert_exact, make_model, train


def fp8_folder(src: Path, dest: Path, e5m2: str | None = None, blockwise: str | None = None):
    """``src``'s checkpoint with every block linear weight stored as float8_e4m3fn: a third with
    a scalar ``scale_weight`` (ComfyUI), a third with per-row ``weight_scale``, a third unscaled
    (scale 1, values within e4m3's range). Returns ``{key: weight as stored (fp32)}``."""
    tensors = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(f))
    out, expected = {}, {}
    linear = [
        k for k, v in tensors.items() if "blocks." in k and k.endswith(".weight") and v.dim() == 2
    ]
    for i, key in enumerate(sorted(tensors)):
        value = tensors[key]
        if key not in linear:
            out[key] = value
            continue
        owner = key.rpartition(".")[0]
        if i % 3 == 0:  # ComfyUI: one scale per tensor
            scale = value.abs().max() / 448
            codes = (value / scale).to(torch.float8_e4m3fn)
            out[f"{owner}.scale_weight"] = scale.reshape(1).float()
            scales = scale.float().expand(value.shape[0])
        elif i % 3 == 1:  # one scale per output row
            codes, scales = quantize(value, "fp8_e4m3")
            out[f"{owner}.weight_scale"] = scales.reshape(-1, 1)
        else:
            codes, scales = value.to(torch.float8_e4m3fn), torch.ones(value.shape[0])
        out[key] = codes
        expected[key] = (codes, scales)
    if e5m2 is not None:
        out[e5m2] = out[e5m2].float().to(torch.float8_e5m2)
    if blockwise is not None:
        owner = blockwise.rpartition(".")[0]
        out.pop(f"{owner}.scale_weight", None)
        out[f"{owner}.weight_scale"] = torch.ones(2, 2)
    dest.mkdir(parents=True)
    save_file(out, dest / "diffusion_pytorch_model.safetensors")
    (dest / "config.json").write_text((src / "config.json").read_text())
    return expected


def section(cache, fmt: str | None = "int8"):
    sh = {
        "pinned_pool_mb": 4,
        "pinned_slab_mb": 1,
        "prefetch_window_blocks": 1,
        "vram_high_watermark_mb": 0,
        "vram_low_watermark_mb": 0,
    }
    if fmt is not None:
        sh["squareq"] = {"format": fmt, "cache_dir": str(cache)}
    return {"strategy": "stagehand", "gradient_checkpointing": True, "stagehand": sh}


@pytest.mark.parity  # the refusals below compare no numbers: not rerun
def test_fp8_checkpoint_streams_as_stored_and_trains_as_its_weights(tiny_flux, tmp_path):
    """The run's format is int8, yet the file's fp8 weights are not requantized: every one is
    copied into the images as stored (``prequantized_layers``), so the streamed run equals the
    model holding the file's own weights (``codes * scale``) resident."""
    folder = tmp_path / "fp8"
    expected = fp8_folder(tiny_flux, folder)
    reference = make_model("flux", tiny_flux, "lora", "non-reentrant", True)
    names = dict(reference.named_parameters())
    for key, (codes, scales) in expected.items():
        lora_base = key.removesuffix(".weight") + ".base_layer.weight"  # a LoRA target's base
        param = names.get(lora_base, names.get(key))
        param.data = dequantize(codes, scales, param.dtype)
    plain = train(reference)
    model = make_model("flux", tiny_flux, "lora", "non-reentrant")
    built = build_strategy(model, section(tmp_path / "sq"), device="cpu", checkpoint_dir=folder)
    info = built.weights.squareq.info
    assert info["prequantized_layers"] == len(expected) > 0
    assert info["quantized_layers"] == 0  # nothing was quantized again
    assert_exact(plain, train(model, built))


@pytest.mark.parametrize("broken", ["e5m2", "blockwise", "no-squareq"])
def test_unreadable_fp8_weight_names_key_and_dtype(tiny_flux, tmp_path, broken):
    folder = tmp_path / "fp8"
    key = "transformer_blocks.0.attn.to_q.weight"
    fp8_folder(
        tiny_flux,
        folder,
        e5m2=key if broken == "e5m2" else None,
        blockwise=key if broken == "blockwise" else None,
    )
    model = make_model("flux", tiny_flux, "lora", "non-reentrant")
    fmt = None if broken == "no-squareq" else "fp8_e4m3"
    with pytest.raises(PrequantizedCheckpointError) as info:
        build_strategy(model, section(tmp_path / "sq", fmt), device="cpu", checkpoint_dir=folder)
    message = str(info.value)
    assert "checkpoint tensor" in message
    if broken == "e5m2":
        assert repr(key) in message and "torch.float8_e5m2" in message
    elif broken == "blockwise":
        assert repr(key) in message and "(2, 2)" in message and "block-wise" in message
    else:
        assert "scale_weight" in message and "memory.stagehand.squareq" in message

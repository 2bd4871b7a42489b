"""The real-family 24 GB presets: their pool, slab and watermark figures follow from the real
models' block sizes (configs built on the meta device, blocks chosen by ``find_blocks``)."""

import re

import pytest
import torch

from runtime.preset import load_preset, validate_preset
from runtime.weights.registry import find_blocks

MB = 1024**2


def block_mb(model, dtype_bytes=2) -> dict[str, float]:
    """Largest block per ModuleList, in MB at ``dtype_bytes`` per parameter."""
    out: dict[str, float] = {}
    for name, module in find_blocks(model):
        n = sum(p.numel() for p in module.parameters()) * dtype_bytes / MB
        key = name.rsplit(".", 1)[0]
        out[key] = max(out.get(key, 0.0), n)
    return out


def test_flux_dev_24gb_is_derived_from_flux_dev_blocks():
    from diffusers import FluxTransformer2DModel
    from transformers import T5Config, T5EncoderModel

    with torch.device("meta"):
        flux = FluxTransformer2DModel(
            in_channels=64,
            num_layers=19,
            num_single_layers=38,
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=4096,
            pooled_projection_dim=768,
            guidance_embeds=True,
            axes_dims_rope=(16, 56, 56),
        )
        t5 = T5EncoderModel(
            T5Config(
                d_model=4096,
                d_ff=10240,
                num_layers=24,
                num_heads=64,
                d_kv=64,
                feed_forward_proj="gated-gelu",  # T5 v1.1 (FLUX.1 text_encoder_2)
            )
        )
    sizes = block_mb(flux)
    assert sizes["transformer_blocks"] == pytest.approx(648.2, abs=0.05)
    assert sizes["single_transformer_blocks"] == pytest.approx(270.1, abs=0.05)
    t5_block = block_mb(t5)["encoder.block"]
    assert t5_block == pytest.approx(368.0, abs=0.05)

    name, raw = load_preset("flux-dev-24gb")
    preset = validate_preset(raw)
    sh = preset.memory.stagehand
    largest = max(sizes.values())
    assert largest <= sh.pinned_slab_mb < largest + 16  # one block per slab, little waste
    assert t5_block <= sh.pinned_slab_mb
    assert sh.pinned_pool_mb == 8 * sh.pinned_slab_mb
    on_gpu = (1 + sh.prefetch_window_blocks) * largest
    assert on_gpu + 122 < sh.vram_low_watermark_mb < sh.vram_high_watermark_mb
    cond = sh.conductor_config
    assert sh.vram_high_watermark_mb < cond.vram_soft_cap_mb < cond.vram_hard_cap_mb <= 24000
    # The description states the figures it was derived from.
    for figure in ("648.2 MB", "270.1 MB", "368.0 MB", "5248 MB", "18000/14000"):
        assert figure in preset.description
    assert re.search(r"not run here", preset.description)
    assert preset.data.max_caption_tokens == 512 and preset.samples.guidance == 3.5


def test_qwen_image_24gb_is_derived_from_qwen_image_blocks():
    from diffusers import QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    with torch.device("meta"):
        transformer = QwenImageTransformer2DModel()  # the defaults are Qwen-Image's config
        encoder = Qwen2_5_VLForConditionalGeneration(
            Qwen2_5_VLConfig(
                text_config={
                    "vocab_size": 152064,
                    "hidden_size": 3584,
                    "intermediate_size": 18944,
                    "num_hidden_layers": 28,
                    "num_attention_heads": 28,
                    "num_key_value_heads": 4,
                },
                vocab_size=152064,
            )
        )
    largest = block_mb(transformer)["transformer_blocks"]
    assert largest == pytest.approx(648.2, abs=0.05)
    text_block = block_mb(encoder)["model.language_model.layers"]
    assert text_block == pytest.approx(444.5, abs=0.05)
    preset = validate_preset(load_preset("qwen-image-24gb")[1])
    sh = preset.memory.stagehand
    assert largest <= sh.pinned_slab_mb < largest + 16 and text_block <= sh.pinned_slab_mb
    assert sh.pinned_pool_mb == 8 * sh.pinned_slab_mb
    assert (1 + sh.prefetch_window_blocks) * largest + 77 < sh.vram_low_watermark_mb
    for figure in ("648.2 MB", "444.5 MB", "5248 MB", "60 blocks", "not run here"):
        assert figure in preset.description


def test_wan21_14b_24gb_is_derived_from_wan_blocks():
    from diffusers import WanTransformer3DModel
    from transformers import UMT5Config, UMT5EncoderModel

    with torch.device("meta"):
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=40,
            attention_head_dim=128,
            in_channels=16,
            out_channels=16,
            text_dim=4096,
            freq_dim=256,
            ffn_dim=13824,
            num_layers=40,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
        )
        umt5 = UMT5EncoderModel(
            UMT5Config(
                vocab_size=256384,
                d_model=4096,
                d_ff=10240,
                num_layers=24,
                num_heads=64,
                d_kv=64,
                feed_forward_proj="gated-gelu",
            )
        )
    largest = block_mb(transformer)["blocks"]
    assert largest == pytest.approx(670.2, abs=0.05)
    assert block_mb(umt5)["encoder.block"] == pytest.approx(368.0, abs=0.05)
    preset = validate_preset(load_preset("wan21-14b-24gb")[1])
    sh = preset.memory.stagehand
    assert largest <= sh.pinned_slab_mb < largest + 16
    assert sh.pinned_pool_mb == 8 * sh.pinned_slab_mb
    assert (1 + sh.prefetch_window_blocks) * largest + 444 < sh.vram_low_watermark_mb
    assert preset.data.frames % 4 == 1  # the Wan VAE's 4k + 1
    for figure in ("670.2 MB", "368.0 MB", "5376 MB", "40 blocks", "not run here"):
        assert figure in preset.description


def test_zimage_24gb_is_derived_from_zimage_blocks():
    from diffusers import ZImageTransformer2DModel
    from transformers import Qwen3Config, Qwen3Model

    with torch.device("meta"):
        transformer = ZImageTransformer2DModel()  # the defaults are Z-Image's config
        qwen3 = Qwen3Model(
            Qwen3Config(
                vocab_size=151936,
                hidden_size=2560,
                intermediate_size=9728,
                num_hidden_layers=36,
                num_attention_heads=32,
                num_key_value_heads=8,
                head_dim=128,
            )
        )
    largest = block_mb(transformer)["layers"]
    assert largest == pytest.approx(345.1, abs=0.05)
    assert block_mb(qwen3)["layers"] == pytest.approx(192.5, abs=0.05)
    preset = validate_preset(load_preset("zimage-24gb")[1])
    sh = preset.memory.stagehand
    assert largest <= sh.pinned_slab_mb < largest + 16
    assert sh.pinned_pool_mb == 8 * sh.pinned_slab_mb
    assert (1 + sh.prefetch_window_blocks) * largest + 1388 < sh.vram_low_watermark_mb
    for figure in ("345.1 MB", "192.5 MB", "2816 MB", "30 layers", "not run here"):
        assert figure in preset.description


def test_ltx2_24gb_is_derived_from_ltx2_blocks():
    from diffusers import LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    with torch.device("meta"):
        transformer = LTX2VideoTransformer3DModel()  # the defaults are LTX-2's config
        connectors = LTX2TextConnectors()
        gemma = Gemma3ForConditionalGeneration(
            Gemma3Config(
                text_config={
                    "vocab_size": 262208,
                    "hidden_size": 3840,
                    "intermediate_size": 15360,
                    "num_hidden_layers": 48,
                    "num_attention_heads": 16,
                    "num_key_value_heads": 8,
                    "head_dim": 256,
                },
                vision_config={
                    "hidden_size": 1152,
                    "intermediate_size": 4304,
                    "num_hidden_layers": 27,
                    "num_attention_heads": 16,
                    "image_size": 896,
                    "patch_size": 14,
                },
            )
        )
    params = sum(p.numel() for p in transformer.parameters())
    assert params / 1e9 == pytest.approx(18.88, abs=0.005)  # the seed's 18.88B
    largest = block_mb(transformer)["transformer_blocks"]
    assert largest == pytest.approx(736.4, abs=0.05)
    gemma_layer = block_mb(gemma)["model.language_model.layers"]
    assert gemma_layer == pytest.approx(427.5, abs=0.05)
    conn_mb = sum(p.numel() for p in connectors.parameters()) * 2 / MB
    assert conn_mb == pytest.approx(2730, abs=1)
    preset = validate_preset(load_preset("ltx2-24gb")[1])
    assert preset.family == "ltx2"
    sh = preset.memory.stagehand
    assert largest <= sh.pinned_slab_mb < largest + 16 and gemma_layer <= sh.pinned_slab_mb
    assert sh.pinned_pool_mb == 8 * sh.pinned_slab_mb
    assert (1 + sh.prefetch_window_blocks) * largest + 657 < sh.vram_low_watermark_mb
    assert preset.data.frames % 8 == 1  # the LTX-2 VAE's 8k + 1
    assert preset.data.max_caption_tokens % 128 == 0  # the connectors' registers
    for figure in ("736.4 MB", "427.5 MB", "2730 MB", "5952 MB", "48 blocks", "not run here"):
        assert figure in preset.description


def test_sd35_large_24gb_is_derived_from_sd35_large_blocks():
    from diffusers import SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    with torch.device("meta"):
        transformer = SD3Transformer2DModel(  # stabilityai/stable-diffusion-3.5-large
            sample_size=128,
            in_channels=16,
            num_layers=38,
            attention_head_dim=64,
            num_attention_heads=38,
            joint_attention_dim=4096,
            caption_projection_dim=2432,
            pooled_projection_dim=2048,
            out_channels=16,
            pos_embed_max_size=192,
            qk_norm="rms_norm",
        )
        clip_g = CLIPTextModelWithProjection(
            CLIPTextConfig(
                vocab_size=49408,
                hidden_size=1280,
                intermediate_size=5120,
                num_hidden_layers=32,
                num_attention_heads=20,
                projection_dim=1280,
            )
        )
    total = sum(p.numel() for p in transformer.parameters())
    assert total == 8_056_627_520  # "8.1B parameters", as Stability AI gives it
    sizes = {
        n: sum(p.numel() for p in m.parameters()) * 2 / MB for n, m in find_blocks(transformer)
    }
    largest = max(sizes.values())
    assert len(sizes) == 38 and largest == pytest.approx(406.3, abs=0.05)
    assert sizes["transformer_blocks.37"] == pytest.approx(259.6, abs=0.05)  # context-pre-only
    resident = total * 2 / MB - sum(sizes.values())
    assert resident == pytest.approx(75.4, abs=0.05)
    assert block_mb(clip_g)["text_model.encoder.layers"] == pytest.approx(37.5, abs=0.05)

    preset = validate_preset(load_preset("sd35-large-24gb")[1])
    sh = preset.memory.stagehand
    assert largest <= sh.pinned_slab_mb < largest + 16
    assert 368.0 <= sh.pinned_slab_mb  # T5-XXL's blocks (test_flux_dev_24gb...) fit a slab
    assert sh.pinned_pool_mb == 8 * sh.pinned_slab_mb
    assert (1 + sh.prefetch_window_blocks) * largest + resident < sh.vram_low_watermark_mb
    cond = sh.conductor_config
    assert sh.vram_high_watermark_mb < cond.vram_soft_cap_mb < cond.vram_hard_cap_mb <= 24000
    for figure in ("8.06B", "15367 MB", "406.3 MB", "259.6 MB", "75.4 MB", "3328 MB", "37.5 MB"):
        assert figure in preset.description
    assert "not run here" in preset.description

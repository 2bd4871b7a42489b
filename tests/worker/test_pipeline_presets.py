"""The real-family 24 GB presets: their pool, slab and watermark figures follow from the real
models' block sizes (configs built on the meta device, blocks chosen by ``find_blocks``).

All but ltx2-24gb (which mirrors its seed) leave the pipeline settings out: the weight runtime
derives them from the blocks it streams and the card (``stagehand.weights.defaults.resolve``), so
these tests derive them the same way, from the blocks of a run (the trainer's LoRA attached, as
``backend/workbench/worker/run.py`` does before building the strategy) on a 24 GB card."""

import re

import pytest
import torch

from stagehand.config.memory import StagehandConfig
from stagehand.strategy.auto import resolve_auto
from stagehand.weights.defaults import block_bytes, resolve
from stagehand.weights.registry import find_blocks
from workbench.plan.profiles import profile
from workbench.worker.loop import attach_adapter
from workbench.worker.pipelines import ADAPTERS
from workbench.worker.preset import load_preset, validate_preset
from workbench.worker.setup import family_targets

MB = 1024**2
CARD = profile("rtx4090").vram_bytes  # a 24 GB card (24 GiB)
DERIVED = ("pinned_pool_mb", "pinned_slab_mb", "prefetch_window_blocks", "max_inflight_transfers")


def block_mb(model, dtype_bytes=2) -> dict[str, float]:
    """Largest block per ModuleList, in MB at ``dtype_bytes`` per parameter."""
    out: dict[str, float] = {}
    for name, module in find_blocks(model):
        n = sum(p.numel() for p in module.parameters()) * dtype_bytes / MB
        key = name.rsplit(".", 1)[0]
        out[key] = max(out.get(key, 0.0), n)
    return out


def t5_xxl():
    """T5-XXL v1.1's encoder (FLUX.1's text_encoder_2, SD 3.5's text_encoder_3), built on meta."""
    from transformers import T5Config, T5EncoderModel

    with torch.device("meta"):
        return T5EncoderModel(
            T5Config(
                d_model=4096,
                d_ff=10240,
                num_layers=24,
                num_heads=64,
                d_kv=64,
                feed_forward_proj="gated-gelu",  # T5 v1.1
            )
        )


def derive(preset, sizes: list[int]) -> StagehandConfig:
    """The preset's weight settings as a run on a 24 GB card resolves them for blocks of
    ``sizes`` (bytes); 16 cores (the reader threads only). ``"auto"`` watermarks and caps as
    the strategy resolves them at build, before any activation is planned or measured (no
    trainable bytes counted: the most the rule gives)."""
    section = resolve_auto(
        preset.memory.stagehand, block_sizes=sizes, trainable=0, activation_peak=0, card_bytes=CARD
    )
    return resolve(section, sizes, cuda=True, vram_bytes=CARD, cpus=16)


def run_blocks(model, preset, family: str) -> tuple[list[int], float]:
    """(block bytes, resident MB) of ``model`` in a run of ``preset``: loaded in bf16 (the
    preset's ``model.dtype``), the family's LoRA targets at the preset's rank with fp32 adapters
    (``attach_adapter``), blocks by ``find_blocks``."""
    assert preset.model.dtype == "bfloat16"
    model.to(torch.bfloat16)
    attach_adapter(model, family_targets(preset, ADAPTERS[family]))
    found = find_blocks(model)
    in_blocks = {id(p) for _, block in found for p in block.parameters()}
    resident = sum(
        p.numel() * p.element_size() for p in model.parameters() if id(p) not in in_blocks
    )
    return block_bytes(found), resident / MB


def check_derived(preset, sizes: list[int], resident_mb: float, *encoders: list[int]):
    """The rules the preset's hard-coded settings were checked against, on the derived ones:
    the four settings left out; a slab holds the largest block (of the transformer, and of each
    stage-1 encoder in the pool derived from its own blocks, as ``encode.py`` builds one runtime
    per encoder from the same section) with under 1 MB to spare; the window's blocks and the one
    in use plus the resident weights under the low watermark; the pools within the Conductor's
    pinned budget (``composed.py`` refuses a run otherwise). Returns the derived settings."""
    assert {name: getattr(preset.memory.stagehand, name) for name in DERIVED} == dict.fromkeys(
        DERIVED
    )
    got = sh = derive(preset, sizes)
    largest = max(sizes)
    assert largest <= got.pinned_slab_mb * MB < largest + MB
    on_gpu = (1 + got.prefetch_window_blocks) * largest / MB
    assert on_gpu + resident_mb < sh.vram_low_watermark_mb < sh.vram_high_watermark_mb
    cond, act = sh.conductor_config, sh.activation_stagehand
    assert sh.vram_high_watermark_mb < cond.vram_soft_cap_mb < cond.vram_hard_cap_mb <= CARD / MB
    assert act.vram_high_watermark_mb == cond.vram_soft_cap_mb  # NOTE [ Who gives way ]
    spill_pool = sum(
        c * n for c, n in zip(act.pinned_pool_classes_mb, act.slab_counts(), strict=True)
    )
    assert got.pinned_pool_mb + spill_pool <= cond.pinned_budget_mb
    for encoder in encoders:
        own = derive(preset, encoder)
        assert max(encoder) <= own.pinned_slab_mb * MB < max(encoder) + MB
        assert own.pinned_pool_mb + spill_pool <= cond.pinned_budget_mb
    return got


def settings(config: StagehandConfig) -> tuple[int, int, int, int]:
    """(window, copies in flight, slab MB, pool MB)."""
    return (
        config.prefetch_window_blocks,
        config.max_inflight_transfers,
        config.pinned_slab_mb,
        config.pinned_pool_mb,
    )


def test_flux_dev_24gb_is_derived_from_flux_dev_blocks():
    from diffusers import FluxTransformer2DModel

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
        t5 = t5_xxl()
    sizes = block_mb(flux)
    assert sizes["transformer_blocks"] == pytest.approx(648.2, abs=0.05)
    assert sizes["single_transformer_blocks"] == pytest.approx(270.1, abs=0.05)
    t5_block = block_mb(t5)["encoder.block"]
    assert t5_block == pytest.approx(368.0, abs=0.05)

    name, raw = load_preset("flux-dev-24gb")
    preset = validate_preset(raw)
    t5_sizes = block_bytes(find_blocks(t5.to(torch.bfloat16)))
    run, resident = run_blocks(flux, preset, "flux")
    assert round(resident) == 122 and max(run) / MB == pytest.approx(654.9, abs=0.05)
    got = check_derived(preset, run, resident, t5_sizes)
    # 1 GiB ahead of 655 MB blocks: 2, within a tenth of 24 GiB; twice as many copies in
    # flight; a slab per copy plus one. Deeper than before (2 copies, 8 slabs of 656 MB) on
    # fewer pinned MB.
    assert settings(got) == (2, 4, 655, 5 * 655)
    assert settings(derive(preset, t5_sizes)) == (3, 6, 369, 7 * 369)
    # The description states the figures it was derived from.
    for figure in ("648.2 MB", "270.1 MB", "368.0 MB", "654.9 MB", "655 MB slab", "3275 MB"):
        assert figure in preset.description
    assert "window 2" in preset.description and "4 H2D copies" in preset.description
    assert '"auto"' in preset.description and "1965 MB" in preset.description
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
    encoder_sizes = block_bytes(find_blocks(encoder.to(torch.bfloat16)))
    run, resident = run_blocks(transformer, preset, "qwenimage")
    assert round(resident) == 77 and max(run) / MB == pytest.approx(649.7, abs=0.05)
    got = check_derived(preset, run, resident, encoder_sizes)
    assert settings(got) == (2, 4, 650, 5 * 650)
    assert settings(derive(preset, encoder_sizes)) == (3, 6, 445, 7 * 445)
    for figure in ("648.2 MB", "444.5 MB", "649.7 MB", "650 MB slab", "3250 MB", "3115 MB"):
        assert figure in preset.description
    for figure in ("60 blocks", "window 2", "1949 MB", "not run here"):
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
    umt5_sizes = block_bytes(find_blocks(umt5.to(torch.bfloat16)))
    run, resident = run_blocks(transformer, preset, "wan")
    assert round(resident) == 444 and max(run) / MB == pytest.approx(684.9, abs=0.05)
    got = check_derived(preset, run, resident, umt5_sizes)
    assert settings(got) == (2, 4, 685, 5 * 685)  # rank 32 on 6 targets: 14.6 MB of adapters
    assert settings(derive(preset, umt5_sizes)) == (3, 6, 369, 7 * 369)
    assert preset.data.frames % 4 == 1  # the Wan VAE's 4k + 1
    for figure in ("670.2 MB", "368.0 MB", "684.9 MB", "685 MB slab", "3425 MB", "2055 MB"):
        assert figure in preset.description
    for figure in ("40 blocks", "window 2", "2583 MB", "not run here"):
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
    qwen3_sizes = block_bytes(find_blocks(qwen3.to(torch.bfloat16)))
    run, resident = run_blocks(transformer, preset, "zimage")
    # The refiner blocks stay resident, their adapters with them (1388 MB without).
    assert resident == pytest.approx(1405.6, abs=0.05) and max(run) / MB == pytest.approx(
        349.5, abs=0.05
    )
    got = check_derived(preset, run, resident, qwen3_sizes)
    # Smaller blocks, a deeper window: 1 GiB ahead is 3 of them.
    assert settings(got) == (3, 6, 350, 7 * 350)
    assert settings(derive(preset, qwen3_sizes)) == (6, 12, 193, 13 * 193)
    for figure in ("345.1 MB", "192.5 MB", "349.5 MB", "350 MB slab", "2450 MB", "2509 MB"):
        assert figure in preset.description
    for figure in ("30 layers", "window 3", "1398 MB", "1406 MB", "not run here"):
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
    low = derive(preset, [int(largest * MB)] * 48).vram_low_watermark_mb
    assert (1 + sh.prefetch_window_blocks) * largest + 657 < low
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
    clip_g_sizes = block_bytes(find_blocks(clip_g.to(torch.bfloat16)))
    t5_sizes = block_bytes(find_blocks(t5_xxl().to(torch.bfloat16)))
    run, run_resident = run_blocks(transformer, preset, "sd3")
    assert run_resident == pytest.approx(resident)  # the adapters are all in the blocks
    assert max(run) / MB == pytest.approx(408.6, abs=0.05)
    got = check_derived(preset, run, run_resident, clip_g_sizes, t5_sizes)
    assert settings(got) == (3, 6, 409, 7 * 409)
    assert settings(derive(preset, clip_g_sizes))[:3] == (8, 16, 38)
    for figure in ("8.06B", "15367 MB", "406.3 MB", "259.6 MB", "75.4 MB", "37.5 MB"):
        assert figure in preset.description
    for figure in ("408.6 MB", "409 MB slab", "2863 MB", "window 3", "1635 MB", "not run here"):
        assert figure in preset.description

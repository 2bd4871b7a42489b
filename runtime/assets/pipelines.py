"""Tiny random-weight diffusers pipelines of the real families, in the Hub's folder layout.

Each pipeline is built from small configs of the real classes (``FluxPipeline``: CLIP + T5 +
``FluxTransformer2DModel`` + ``AutoencoderKL`` + ``FlowMatchEulerDiscreteScheduler``), with
tokenizers made offline by the ``tokenizers`` library and wrapped in the tokenizer class the
pipeline expects, then written with ``save_pretrained(max_shard_size=...)`` so the transformer
is sharded with an index, exactly as a downloaded pipeline folder is. Shapes are ones the
defaults would not give (odd layer counts, non-square images): the trainer must read every
size from the configs.

Pitfalls met on the way (transformers 5, diffusers 0.42): CLIP pools at the highest token id
when ``eos_token_id`` is 2, so ``<|endoftext|>`` is the last id; diffusers models load in fp32
while transformers encoders keep the stored dtype, so loaders pass ``dtype=``.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from .cache import AssetError, build_once, cache_root
from .tiny_tokenizers import (
    QWEN3_CHAT_TEMPLATE,
    SEED,
    WORDS,
    clip_tokenizer,
    qwen_tokenizer,
    t5_tokenizer,
)


def flux_pipeline(seed: int = SEED):
    """A ``FluxPipeline`` (dev-style: guidance embeddings) with odd sizes everywhere:
    CLIP 3 layers hidden 20, T5 3 layers d_model 24, transformer 3 double + 5 single blocks,
    VAE 4 latent channels and a 4x downscale (3 blocks)."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        FluxTransformer2DModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tok, tok2 = clip_tokenizer(), t5_tokenizer()
    torch.manual_seed(seed)
    clip = CLIPTextModel(
        CLIPTextConfig(
            vocab_size=len(tok),
            hidden_size=20,
            intermediate_size=36,
            num_hidden_layers=3,
            num_attention_heads=2,
            max_position_embeddings=77,
            eos_token_id=tok.eos_token_id,
            bos_token_id=tok.bos_token_id,
            pad_token_id=tok.pad_token_id,
            projection_dim=20,
        )
    )
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=len(tok2),
            d_model=24,
            d_kv=6,
            d_ff=40,
            num_layers=3,
            num_heads=4,
            relative_attention_num_buckets=8,
            decoder_start_token_id=0,
        )
    )
    transformer = FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,  # 4 latent channels x 2x2 packing
        num_layers=3,
        num_single_layers=5,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=24,  # T5 d_model
        pooled_projection_dim=20,  # CLIP hidden size
        guidance_embeds=True,
        axes_dims_rope=(2, 2, 4),
    )
    vae = _flux_style_vae(scaling_factor=0.37, shift_factor=0.11)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0,
        use_dynamic_shifting=True,
        base_image_seq_len=16,
        max_image_seq_len=256,
        base_shift=0.5,
        max_shift=1.15,
    )
    return FluxPipeline(
        scheduler=scheduler,
        vae=vae,
        text_encoder=clip,
        tokenizer=tok,
        text_encoder_2=t5,
        tokenizer_2=tok2,
        transformer=transformer,
    )


def qwenimage_pipeline(seed: int = SEED):
    """A ``QwenImagePipeline`` with odd sizes: Qwen2.5-VL text model of 3 layers (hidden 24,
    its vision tower 1 block), transformer of 3 blocks, VAE with z_dim 4 and 4x downscale."""
    from diffusers import (
        AutoencoderKLQwenImage,
        FlowMatchEulerDiscreteScheduler,
        QwenImagePipeline,
        QwenImageTransformer2DModel,
    )
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tok = qwen_tokenizer()
    torch.manual_seed(seed)
    n = len(tok)  # the vision special tokens come after the tokenizer's ids
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": n + 4,
            "bos_token_id": tok.convert_tokens_to_ids("<|endoftext|>"),
            "eos_token_id": tok.convert_tokens_to_ids("<|im_end|>"),
            "hidden_size": 24,
            "intermediate_size": 40,
            "num_hidden_layers": 3,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "mrope_section": [1, 1, 4]},
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 16,
            "num_heads": 2,
            "out_hidden_size": 24,
            "fullatt_block_indexes": [0],
        },
        vocab_size=n + 4,
        image_token_id=n,
        video_token_id=n + 1,
        vision_start_token_id=n + 2,
        vision_end_token_id=n + 3,
    )
    encoder = Qwen2_5_VLForConditionalGeneration(config)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,  # 4 latent channels x 2x2 packing
        out_channels=4,
        num_layers=3,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=24,  # the text model's hidden size
        axes_dims_rope=(2, 2, 4),
    )
    vae = AutoencoderKLQwenImage(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 2, 2],
        num_res_blocks=1,
        temperal_downsample=[False, True],
        latents_mean=[0.1, -0.2, 0.3, 0.05],
        latents_std=[1.5, 0.8, 2.0, 1.1],
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=0.9,
        base_image_seq_len=16,
        max_image_seq_len=512,
        time_shift_type="exponential",
    )
    return QwenImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=encoder, tokenizer=tok, transformer=transformer
    )


def wan_pipeline(seed: int = SEED, experts: int = 1):
    """A ``WanPipeline`` (Wan 2.1 layout; ``experts=2``: Wan 2.2's high/low-noise pair with
    ``boundary_ratio`` 0.875): UMT5 3 layers d_model 20, transformer 3 blocks, 3D VAE z_dim 4
    (8x spatial, 4x temporal), UniPC with flow sigmas and ``flow_shift`` 3 as Wan ships."""
    from diffusers import (
        AutoencoderKLWan,
        UniPCMultistepScheduler,
        WanPipeline,
        WanTransformer3DModel,
    )
    from transformers import UMT5Config, UMT5EncoderModel

    tok = t5_tokenizer()
    torch.manual_seed(seed)
    encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tok),
            d_model=20,
            d_kv=10,
            d_ff=36,
            num_layers=3,
            num_heads=2,
            relative_attention_num_buckets=8,
        )
    )

    def transformer():
        return WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=8,
            in_channels=4,
            out_channels=4,
            text_dim=20,  # UMT5 d_model
            freq_dim=16,
            ffn_dim=24,
            num_layers=3,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        )

    vae = AutoencoderKLWan(
        base_dim=8,
        z_dim=4,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.1, -0.2, 0.3, 0.05],
        latents_std=[1.5, 0.8, 2.0, 1.1],
    )
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    return WanPipeline(
        tokenizer=tok,
        text_encoder=encoder,
        vae=vae,
        scheduler=scheduler,
        transformer=transformer(),
        transformer_2=transformer() if experts == 2 else None,
        boundary_ratio=0.875 if experts == 2 else None,
    )


def zimage_pipeline(seed: int = SEED):
    """A ``ZImagePipeline``: Qwen3 text model of 3 layers (hidden 24; the pipeline reads the
    second-to-last hidden state), transformer of 3 layers with 1 noise and 1 context refiner,
    the Flux-style ``AutoencoderKL`` with 4 latent channels and a 4x downscale."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        ZImagePipeline,
        ZImageTransformer2DModel,
    )
    from transformers import Qwen3Config, Qwen3Model

    tok = qwen_tokenizer()
    tok.chat_template = QWEN3_CHAT_TEMPLATE
    torch.manual_seed(seed)
    encoder = Qwen3Model(
        Qwen3Config(
            vocab_size=len(tok),
            hidden_size=24,
            intermediate_size=40,
            num_hidden_layers=3,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=12,
            max_position_embeddings=1024,
        )
    )
    transformer = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=4,
        dim=24,
        n_layers=3,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=24,  # the text model's hidden size
        axes_dims=[4, 4, 4],
        axes_lens=[256, 64, 64],
    )
    vae = _flux_style_vae(scaling_factor=0.3611, shift_factor=0.1159)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=False)
    return ZImagePipeline(
        scheduler=scheduler, vae=vae, text_encoder=encoder, tokenizer=tok, transformer=transformer
    )


def ltx2_pipeline(seed: int = SEED):
    """An ``LTX2Pipeline`` (``ltx2_pipeline.py``: Gemma 3 3 layers, connectors, 3 blocks, video
    and audio VAEs, vocoder) over this module's words."""
    from .ltx2_pipeline import ltx2_pipeline as build

    return build(WORDS, seed)


BUILDERS = {
    "flux": flux_pipeline,
    "qwenimage": qwenimage_pipeline,
    "wan": wan_pipeline,
    "wan22": lambda: wan_pipeline(experts=2),
    "zimage": zimage_pipeline,
    "ltx2": ltx2_pipeline,
    "sd3": lambda: _sd("sd3_pipeline"),
    "sdxl": lambda: _sd("sdxl_pipeline"),
    "flux2": lambda: _flux2(),
}


def _sd(builder: str):
    """A builder of ``sd_pipelines.py`` (SD 3.5, SDXL), imported on use (it imports this
    module's tokenizers)."""
    from . import sd_pipelines

    return getattr(sd_pipelines, builder)()


def _flux2():
    """``flux2_pipeline.py``'s FLUX.2 [klein], imported on use (it imports this module)."""
    from .flux2_pipeline import flux2_klein_pipeline

    return flux2_klein_pipeline()


def save_pipeline(pipe, folder: Path) -> None:
    """``save_pretrained`` with shards small enough that the transformer has several."""
    denoiser = getattr(pipe, "transformer", None) or pipe.unet
    total = sum(p.numel() * p.element_size() for p in denoiser.parameters())
    pipe.save_pretrained(folder, safe_serialization=True, max_shard_size=max(total // 3, 1))


def build_pipeline(family: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The tiny ``family`` pipeline folder under ``<cache>/pipelines/``, built once.

    Raises:
        AssetError: an unknown family (lists the known).
    """
    if family not in BUILDERS:
        raise AssetError(f"no tiny pipeline for family {family!r}; known: {list(BUILDERS)}")
    final = cache_root(cache_dir) / "pipelines" / f"{family}-tiny"
    # Any change to the builders rebuilds: the spec holds their files' hash.
    here = Path(__file__).parent
    sources = [
        here / name
        for name in (
            "pipelines.py",
            "tiny_tokenizers.py",
            "ltx2_pipeline.py",
            "sd_pipelines.py",
            "flux2_pipeline.py",
        )
    ]
    source = hashlib.sha256(b"".join(f.read_bytes() for f in sources)).hexdigest()
    spec = {"family": family, "seed": SEED, "source": source}
    return build_once(final, spec, lambda tmp: save_pipeline(BUILDERS[family](), tmp))


def _flux_style_vae(scaling_factor: float, shift_factor: float):
    """The tiny AutoencoderKL of the Flux-style pipelines (Flux, Z-Image): 3 levels, 4 latent
    channels, no quant convs; the pipelines differ in their latent scaling and shift."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(8, 16, 16),
        latent_channels=4,
        layers_per_block=1,
        norm_num_groups=4,
        sample_size=32,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )

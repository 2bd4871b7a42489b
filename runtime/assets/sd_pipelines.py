"""Tiny random-weight Stable Diffusion pipelines (SD 3.5, SDXL) from small configs of the real
classes, with the tokenizers of ``pipelines.py`` (built offline).

- ``StableDiffusion3Pipeline`` as ``stabilityai/stable-diffusion-3.5-medium`` lays it out: two
  ``CLIPTextModelWithProjection`` (CLIP-L, CLIP-G), ``T5EncoderModel``, ``SD3Transformer2DModel``
  with RMS q/k norms and one dual-attention (MMDiT-X) layer, the 16-channel-style
  ``AutoencoderKL`` with ``shift_factor``, ``FlowMatchEulerDiscreteScheduler`` with shift 3.
- ``StableDiffusionXLPipeline`` as ``stabilityai/stable-diffusion-xl-base-1.0``: CLIP-L
  (``CLIPTextModel``) and CLIP-G (``CLIPTextModelWithProjection``), ``UNet2DConditionModel``
  with ``addition_embed_type="text_time"``, ``AutoencoderKL`` (``scaling_factor`` only),
  ``EulerDiscreteScheduler`` on the scaled-linear betas.

Sizes are ones the defaults would not give (odd layer counts, unequal CLIP widths) so the
adapters must read every size from the configs.
"""

from __future__ import annotations

import torch

from .tiny_tokenizers import SEED, clip_tokenizer, t5_tokenizer


def _clip(tok, hidden: int, layers: int, projection: int | None):
    """A CLIP text model over ``tok`` (``CLIPTextModelWithProjection`` when ``projection``)."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    config = CLIPTextConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden - 4,
        num_hidden_layers=layers,
        num_attention_heads=2,
        max_position_embeddings=77,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
        pad_token_id=tok.pad_token_id,
        projection_dim=projection or hidden,
    )
    return CLIPTextModelWithProjection(config) if projection else CLIPTextModel(config)


def _vae(latent_channels: int, scaling_factor: float, shift_factor: float | None):
    """A 3-level ``AutoencoderKL`` (4x downscale) with SD's quant convs."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        block_out_channels=(8, 16, 16),
        latent_channels=latent_channels,
        layers_per_block=1,
        norm_num_groups=4,
        sample_size=32,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
        use_quant_conv=shift_factor is None,  # SD3's VAE has none, SDXL's has both
        use_post_quant_conv=shift_factor is None,
    )


def sd3_pipeline(seed: int = SEED):
    """A ``StableDiffusion3Pipeline`` (SD 3.5 medium layout): CLIP-L 3 layers hidden 20
    (projection 12), CLIP-G 5 layers hidden 28 (projection 14), T5 3 layers d_model 56 (>= 20 +
    28, the CLIP features are zero-padded to it), transformer of 3 joint blocks (the first with
    dual attention, the last context-pre-only), VAE with 4 latent channels and a 4x downscale."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import T5Config, T5EncoderModel

    tok, tok2, tok3 = clip_tokenizer(), clip_tokenizer(), t5_tokenizer()
    torch.manual_seed(seed)
    clip_l = _clip(tok, hidden=20, layers=3, projection=12)
    clip_g = _clip(tok2, hidden=28, layers=5, projection=14)
    t5 = T5EncoderModel(
        T5Config(
            vocab_size=len(tok3),
            d_model=56,
            d_kv=14,
            d_ff=40,
            num_layers=3,
            num_heads=4,
            relative_attention_num_buckets=8,
            decoder_start_token_id=0,
        )
    )
    transformer = SD3Transformer2DModel(
        sample_size=16,
        patch_size=2,
        in_channels=4,
        num_layers=3,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=56,  # T5 d_model
        caption_projection_dim=16,  # heads x head dim, as SD3 sets it
        pooled_projection_dim=26,  # CLIP-L + CLIP-G projections
        out_channels=4,
        pos_embed_max_size=24,
        dual_attention_layers=(0,),
        qk_norm="rms_norm",
    )
    vae = _vae(4, scaling_factor=1.5305, shift_factor=0.0609)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0)
    return StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=scheduler,
        vae=vae,
        text_encoder=clip_l,
        tokenizer=tok,
        text_encoder_2=clip_g,
        tokenizer_2=tok2,
        text_encoder_3=t5,
        tokenizer_3=tok3,
    )


def sdxl_pipeline(seed: int = SEED):
    """A ``StableDiffusionXLPipeline`` (SDXL base layout): CLIP-L 3 layers hidden 20, CLIP-G 5
    layers hidden 28 (projection 14), UNet of 2 levels (8, 16 channels; one resnet per down
    level, transformer depths 1, 3 where SDXL has 1, 2, 10: the deepest level and the mid
    block are the deep ones), ``text_time`` added
    conditioning of 6 x 4 time features + 14 pooled, VAE with 4 latent channels and a 4x
    downscale, Euler on the scaled-linear betas with ``prediction_type`` v_prediction (the
    non-default branch: SDXL base predicts epsilon, v-prediction finetunes exist)."""
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline, UNet2DConditionModel

    tok, tok2 = clip_tokenizer(), clip_tokenizer()
    torch.manual_seed(seed)
    clip_l = _clip(tok, hidden=20, layers=3, projection=None)
    clip_g = _clip(tok2, hidden=28, layers=5, projection=14)
    unet = UNet2DConditionModel(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        transformer_layers_per_block=(1, 3),
        attention_head_dim=(2, 4),  # heads per level, as SDXL's config names them
        cross_attention_dim=48,  # CLIP-L + CLIP-G hidden sizes
        use_linear_projection=True,
        addition_embed_type="text_time",
        addition_time_embed_dim=4,
        projection_class_embeddings_input_dim=6 * 4 + 14,
        norm_num_groups=4,
    )
    vae = _vae(4, scaling_factor=0.13025, shift_factor=None)
    scheduler = EulerDiscreteScheduler(
        num_train_timesteps=1000,
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        prediction_type="v_prediction",
        steps_offset=1,
        timestep_spacing="leading",
    )
    return StableDiffusionXLPipeline(
        vae=vae,
        text_encoder=clip_l,
        text_encoder_2=clip_g,
        tokenizer=tok,
        tokenizer_2=tok2,
        unet=unet,
        scheduler=scheduler,
    )
